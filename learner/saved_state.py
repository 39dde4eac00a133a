"""What a learner keeps across its restarts, in its ``state_dir``.

Its step, tokens and incarnation (:class:`~learner.telemetry.ProgressFile`),
its inner optimizer's state when it has one, and, without a syncer, its own
weights: there they are the model (an elastic data-parallel group's
checkpoint); with one, a restarted learner takes the global model instead.
"""

from __future__ import annotations

import io
import logging
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from broker.errors import ConfigError
from broker.files import atomic_write
from learner.telemetry import ProgressFile

log = logging.getLogger(__name__)


@contextmanager
def _restoring(path: Path) -> Iterator[None]:
    """Restoring what an earlier incarnation saved at ``path``: a file of another
    model or optimizer (or a torn one) is a state folder to change, not a bug."""
    try:
        yield
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise ConfigError(
            f"{path} is not this learner's saved state ({e}): give another state_dir "
            "or delete that file"
        ) from e


class SavedState:
    def __init__(
        self,
        state_dir: str | None,
        learner_id: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        keeps_weights: bool,
    ) -> None:
        self.learner_id = learner_id
        self.progress = ProgressFile(state_dir, learner_id)
        base = self.progress.path
        self._files: list[tuple[Path, torch.nn.Module | torch.optim.Optimizer]] = []
        if base is not None and keeps_weights:
            self._files.append((base.with_suffix(".model.pt"), model))
        if base is not None and optimizer is not None:
            self._files.append((base.with_suffix(".optimizer.pt"), optimizer))

    def load(self) -> tuple[int, int, int]:
        """(step, tokens, incarnation) the previous incarnation saved last, or zeros."""
        return self.progress.load()

    def restore(self) -> None:
        """Load the saved weights and optimizer state, where there are any."""
        for path, state in self._files:
            if not path.exists():
                continue
            with _restoring(path):
                # weights_only: tensors and plain values, never code.
                state.load_state_dict(torch.load(io.BytesIO(path.read_bytes()), weights_only=True))
            what = "weights" if isinstance(state, torch.nn.Module) else "inner optimizer's state"
            log.info("learner %s: restored its %s", self.learner_id, what)

    def save(self, step: int, tokens: int, incarnation: int) -> None:
        """Weights and optimizer go first: a kill between the writes leaves them
        at most one save ahead of the step they resume from, never behind."""
        for path, state in self._files:
            buffer = io.BytesIO()
            torch.save(state.state_dict(), buffer)
            atomic_write(path, buffer.getvalue())
        self.progress.save(step, tokens, incarnation)
