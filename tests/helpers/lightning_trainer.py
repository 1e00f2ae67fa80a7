"""A Lightning `Trainer` script as people write one: a LightningModule, a
random data set, the DDP strategy on CPU (gloo); under torchrun Lightning
takes the ranks from torchrun's variables. It calls nothing of ddpkit.

  python lightning_trainer.py ROOT_DIR EPOCHS NODES [stop]

With `stop`, the program adds ddpkit's callback (stopped with `last.ckpt` on a
stop signal) and a ModelCheckpoint in ROOT_DIR/ckpt, and resumes with ckpt_path="last".
"""

import sys

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
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    root, epochs, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = sys.argv[4:] == ["stop"]
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.rand(256, 20, generator=generator), torch.rand(256, 1, generator=generator))
    if not stop:
        trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy="ddp", max_epochs=epochs,
                            default_root_dir=root, enable_progress_bar=False, logger=False,
                            enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(Regressor(), DataLoader(data, batch_size=16))
        return
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ddpkit.frameworks.lightning import StopCallback

    trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=nodes, strategy="ddp", max_epochs=epochs,
                        default_root_dir=root, enable_progress_bar=False, logger=False, enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=f"{root}/ckpt", save_top_k=0), StopCallback()])
    trainer.fit(Regressor(), DataLoader(data, batch_size=16), ckpt_path="last")


if __name__ == "__main__":
    main()
