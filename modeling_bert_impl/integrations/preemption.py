"""Training that stops cleanly when the cluster takes the machine back: `PreemptionCallback`, for any `Trainer`.

SLURM (`sbatch --signal`), Kubernetes (`terminationGracePeriodSeconds`) and preemptible clouds send SIGTERM (or
SIGUSR1) some seconds before SIGKILL. On such a signal the callback lets the running optimizer step finish, tells every
process at the next step boundary (one all-reduce of one number, so a signal that reached one rank is enough), has the
Trainer write one checkpoint, and ends the process with `PREEMPTED_EXIT_STATUS` after a line naming the checkpoint and
how to resume it. `trainer.train()` does not return, so a script never goes on to save a final model or results as if
training had finished:

    trainer = Trainer(model, args, train_dataset=train, callbacks=[PreemptionCallback()])
    trainer.train(resume_from_checkpoint=...)

- The handlers are installed when the callback is made: make it before the data is prepared. A signal that arrives
  before the first step, during an evaluation or during a checkpoint save is honoured at the next point every process
  reaches (the start of training, the evaluation's end, the save's end), with no save where no step ran.
- A second signal stops the process at once; a checkpoint it interrupts in a plain `Trainer` (written in place) is
  deleted, so that the newest checkpoint left is complete. The same signal again within `REPEAT_SECONDS` is the
  first one delivered twice, not a second: SLURM signals every process of a job step, and torchrun forwards what it
  gets to its workers, so a worker under `srun torchrun` receives it from both.
- transformers' `--enable_jit_checkpoint` handler is replaced while the callback trains: it waits 3 s, lets each
  process decide alone, and lets `train()` return as if the run had finished.
"""

import logging
import os
import shutil
import signal
import threading
import time

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_STATUS = 75  # sysexits.h's EX_TEMPFAIL, "try again later": not finished, not failed
DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
REPEAT_SECONDS = 2.0  # torchrun forwards a signal within its monitor interval (0.1 s by default)


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """The signals of a comma-separated list of names ("SIGTERM,SIGUSR1", "TERM", "usr1"); "none" for none. A
    ValueError names a name that is not a signal."""
    if text.strip().lower() == "none":
        return ()
    found = []
    for name in filter(None, (part.strip().upper() for part in text.split(","))):
        name = name if name.startswith("SIG") else "SIG" + name
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"{text!r}: {name} is not a signal a process can catch; give names such as "
                             f"SIGTERM,SIGUSR1, or none")
        found.append(signal.Signals[name])
    return tuple(dict.fromkeys(found))


def any_process(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is true on any process of the default process group (itself without one). Every process must
    call it at the same point."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    if torch.distributed.get_world_size() == 1:
        return flag
    value = torch.tensor([float(flag)], device=device)  # on the device, for NCCL
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def checkpoint_path(args, state) -> str:
    """The folder the Trainer saves this step's checkpoint as."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


class PreemptionCallback(TrainerCallback):
    """Checkpoint and stop on `signals` (names, comma-separated, or a tuple of names or `signal.Signals`; default
    SIGTERM and SIGUSR1), as the module says. `resume` is the advice the last line gives (default:
    `trainer.train(resume_from_checkpoint=...)` with the checkpoint's path)."""

    def __init__(self, signals: str | tuple = DEFAULT_SIGNALS, resume: str | None = None):
        if not isinstance(signals, str):
            signals = ",".join(getattr(s, "name", s) for s in signals) or "none"
        self.signals = parse_signals(signals)
        self.resume = resume
        self.received: str | None = None  # the first signal's name
        self.received_at = 0.0
        self.stopping = False  # every process knows of a signal
        self.training = False
        self.saved: str | None = None  # the checkpoint written on the signal
        self.writing: str | None = None  # a checkpoint the Trainer is writing in place, deleted on a second signal
        self.previous = {}
        self.install()

    def install(self) -> None:
        """Handle `signals` from now on (again after transformers' JIT checkpoint took SIGTERM)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionCallback: make it in the main thread, where Python delivers signals")
        for number in self.signals:
            previous = signal.signal(number, self.handle)
            self.previous.setdefault(number, previous)

    def restore(self) -> None:
        """The handlers from before the callback."""
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous.clear()

    def handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.received is None:
            self.received, self.received_at = name, time.monotonic()
            logger.warning(f"{name} received: the run saves a checkpoint once this step ends, then stops (a second "
                           "signal stops it at once)")
            return
        if name == self.received and time.monotonic() - self.received_at < REPEAT_SECONDS:
            return
        if self.writing and not os.path.isfile(os.path.join(self.writing, "trainer_state.json")):
            shutil.rmtree(self.writing, ignore_errors=True)  # half-written in place: the older checkpoint stays newest
        signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)

    def decide(self, args) -> bool:
        """Whether any process has had a signal; every process calls this at the same points."""
        if not self.stopping and self.training:
            self.stopping = any_process(self.received is not None, args.device)
        return self.stopping

    def on_init_end(self, args, state, control, **kwargs):
        self.install()  # transformers' JIT checkpoint took SIGTERM while the Trainer was made

    def on_train_begin(self, args, state, control, **kwargs):
        self.install()
        self.training = True
        if self.decide(args):
            self.finish(args, state, f"nothing to save: stopped before step {state.global_step + 1}")

    def on_step_end(self, args, state, control, **kwargs):
        self.save_now(args, state, control)
        if control.should_save:
            path = checkpoint_path(args, state)
            self.writing = None if os.path.exists(path) else path

    def on_epoch_end(self, args, state, control, **kwargs):
        self.save_now(args, state, control)

    def on_evaluate(self, args, state, control, **kwargs):
        if self.training and not self.saved:
            self.save_now(args, state, control)

    def save_now(self, args, state, control) -> None:
        """On a signal: save this step (unless saved already), evaluate no more, and stop."""
        if self.decide(args):
            control.should_save = self.saved is None
            control.should_evaluate = False
            control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        self.writing = None
        if self.decide(args) and self.saved is None:  # this save's step is the one to resume
            self.saved = checkpoint_path(args, state)
            state.best_model_checkpoint = None  # no loading it or pruning to it on the way out (the saved state has it)
            control.should_save, control.should_evaluate, control.should_training_stop = False, False, True

    def on_train_end(self, args, state, control, **kwargs):
        self.training = False
        if self.stopping:
            self.finish(args, state, f"saved {self.saved}")
        self.restore()

    def finish(self, args, state, what: str) -> None:
        """Say what was saved and how to resume, leave the process group, and end the process as preempted."""
        self.restore()
        if state.is_world_process_zero:
            resume = self.resume or (f"trainer.train(resume_from_checkpoint={self.saved!r})" if self.saved else
                                     "run the script again")
            logger.warning(f"preempted ({self.received or 'a signal to another process'}) at step "
                           f"{state.global_step}: {what}. Resume: {resume}")
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        raise SystemExit(PREEMPTED_EXIT_STATUS)
