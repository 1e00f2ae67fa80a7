"""A Lightning `Trainer` script as people write one: a LightningModule, a
random data set, the DDP strategy on CPU (gloo); under torchrun Lightning
takes the ranks from torchrun's variables. It calls nothing of ddpkit.

  python lightning_trainer.py ROOT_DIR EPOCHS NODES [stop|resume]

With `stop`, the program adds ddpkit's callback (stopped with `last.ckpt` on a
stop signal) and a ModelCheckpoint in ROOT_DIR/ckpt, and resumes with ckpt_path="last".
With `resume`, a ModelCheckpoint writes `last.ckpt` every 5 steps and the program
resumes from it (an elastic job's restart), with no call into ddpkit. NODES
`env` takes the node count from torchrun's variables, as an elastic script must:
Lightning refuses a world size other than num_nodes x devices. The test knob
STEP_SLEEP_S (environment) makes each step that much longer. Without a mode it
keeps Lightning's default progress bar (rich's); with one, no bar.
"""

import os
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    root, epochs = sys.argv[1], int(sys.argv[2])
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]) if sys.argv[3] == "env" \
        else int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    stop = mode == "stop"
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(256, 20, generator=generator), torch.rand(256, 1, generator=generator))
    if not mode:
        # Lightning's default progress bar: RichProgressBar, rich being installed
        trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy="ddp", max_epochs=epochs,
                            default_root_dir=root, logger=False, enable_checkpointing=False,
                            enable_model_summary=False)
        trainer.fit(Regressor(), DataLoader(data, batch_size=16))
        return
    from lightning.pytorch.callbacks import ModelCheckpoint

    if stop:
        from ddpkit.frameworks.lightning import StopCallback

        callbacks = [ModelCheckpoint(dirpath=f"{root}/ckpt", save_top_k=0), StopCallback()]
    else:
        callbacks = [ModelCheckpoint(dirpath=f"{root}/ckpt", save_top_k=0, save_last=True, every_n_train_steps=5)]
    if os.path.exists(f"{root}/ckpt/last.ckpt"):
        print(f"resuming from {root}/ckpt/last.ckpt", flush=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy="ddp", max_epochs=epochs,
                        default_root_dir=root, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(Regressor(), DataLoader(data, batch_size=16), ckpt_path="last")


if __name__ == "__main__":
    main()
