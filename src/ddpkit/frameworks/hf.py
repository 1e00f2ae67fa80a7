"""A Hugging Face Transformers `Trainer` stopped the way ddpkit stops a job:
after a stop signal, at the optimizer step every rank agreed on, the Trainer
saves a checkpoint (its own `checkpoint-<step>` in `output_dir`, through its
own saving) and stops; the process then exits 75, so that Slurm requeues the
job and the next start resumes with
`trainer.train(resume_from_checkpoint=get_last_checkpoint(output_dir))`
(transformers.trainer_utils; None on the first start).

    from ddpkit.frameworks.hf import StopCallback
    Trainer(model=model, args=args, train_dataset=data, callbacks=[StopCallback()])
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..preamble import stop


class StopCallback(TrainerCallback):
    """Save and stop at the agreed step; end the process as pre-empted when training ended."""

    def __init__(self) -> None:
        stop.install_once()
        stop.attach_framework()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if stop.agreed():
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if stop.agreed():
            stop.finish(state.global_step)  # its checkpoint-<global_step>, counted on across resumes
