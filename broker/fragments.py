"""Fragment plan: how a model is cut into P fragments that sync at staggered steps.

Learner and syncer must agree on the plan bit for bit, so it is computed only
from the model's parameter names, shapes and dtypes (never from values or from
dict ordering that could differ between processes) and identified by a hash
that every message carries.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from broker.errors import ConfigError
from broker.wire.messages import DEFAULT_MAX_PAYLOAD_BYTES, FRAME_PREFIX_BYTES, MAX_HEADER_BYTES


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


_WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DistributedDataParallel, torch.compile


def synced_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters a plan covers, by their plain names.

    Trainable parameters only: a frozen one is never sent or changed. Tied
    parameters (one tensor under two names) appear once, under the first name,
    as ``named_parameters`` gives them. A model wrapped in
    DistributedDataParallel (or compiled) maps to the same names as the bare
    model, so wrapped and unwrapped learners share one plan.
    """
    out: dict[str, torch.nn.Parameter] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        out[name] = param
    return out


def param_specs(named: Iterable[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """Specs of a model's parameters, e.g. ``param_specs(model.named_parameters())``."""
    return [
        ParamSpec(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in named
    ]


def owner_shard(fragment: int, syncer_shards: int) -> int:
    """The syncer shard that serves ``fragment`` when ``syncer_shards`` syncers
    share a run: fragments go round robin, so shards stay within one fragment
    of each other in count (and, the plan's fragments being near equal, in size)."""
    return fragment % syncer_shards


def owned_fragments(syncer_shard: int, syncer_shards: int, num_fragments: int) -> list[int]:
    """The fragments syncer shard ``syncer_shard`` serves (:func:`owner_shard`)."""
    return [p for p in range(num_fragments) if owner_shard(p, syncer_shards) == syncer_shard]


def assign_fragments(sizes: Sequence[int], num_fragments: int) -> list[int]:
    """Greedy longest-processing-time bin packing.

    Tensors go largest first (ties broken by position, so the result is
    deterministic) to the currently lightest fragment (ties: lowest index).
    The classic bound applies: when no tensor exceeds a third of the ideal
    fragment size, the largest fragment is within 4/3 of the ideal.
    Returns the fragment index of each tensor.
    """
    if num_fragments < 1:
        raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
    if len(sizes) < num_fragments:
        raise ConfigError(
            f"cannot cut {len(sizes)} tensors into {num_fragments} fragments; "
            f"use at most {len(sizes)} fragments"
        )
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    loads = [0] * num_fragments
    counts = [0] * num_fragments
    owner = [0] * len(sizes)
    remaining = len(sizes)
    for i in order:
        empty = [p for p in range(num_fragments) if counts[p] == 0]
        # Every fragment must get at least one tensor: once the tensors left
        # are only just enough for the empty fragments, fill those first.
        candidates = empty if len(empty) >= remaining else range(num_fragments)
        p = min(candidates, key=lambda q: (loads[q], q))
        owner[i] = p
        loads[p] += sizes[i]
        counts[p] += 1
        remaining -= 1
    return owner


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameters form each fragment, and when each fragment syncs."""

    specs: tuple[ParamSpec, ...]
    owner: tuple[int, ...]  # fragment index of each spec
    num_fragments: int
    sync_every: int  # H: inner steps between two syncs of the same fragment

    @classmethod
    def build(
        cls, specs: Sequence[ParamSpec], num_fragments: int, sync_every: int | None = None
    ) -> FragmentPlan:
        if num_fragments < 1:
            raise ConfigError(f"num_fragments must be >= 1, got {num_fragments}")
        sync_every = num_fragments if sync_every is None else sync_every
        if sync_every < 1 or sync_every % num_fragments != 0:
            raise ConfigError(
                f"sync_every (H={sync_every}) must be a positive multiple of the number "
                f"of fragments (P={num_fragments})"
            )
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ConfigError("parameter names must be unique")
        owner = assign_fragments([s.nbytes for s in specs], num_fragments)
        plan = cls(tuple(specs), tuple(owner), num_fragments, sync_every)
        plan.check_fp32_fits()
        return plan

    def check_fp32_fits(self) -> None:
        """Every fragment must fit one message in fp32 (a snapshot, which any
        learner may ask for): :class:`ConfigError` at the plan's making, naming
        the fragment and the fragments that would do, rather than a refused
        message mid-run."""
        for p in range(self.num_fragments):
            fp32_bytes = 4 * self.fragment_numel(p)
            if fp32_bytes > DEFAULT_MAX_PAYLOAD_BYTES:
                at_least = math.ceil(4 * self.total_numel / DEFAULT_MAX_PAYLOAD_BYTES)
                raise ConfigError(
                    f"fragment {p} holds {self.fragment_numel(p):,} values, "
                    f"{fp32_bytes / 2**20:,.0f} MiB in fp32: over the "
                    f"{DEFAULT_MAX_PAYLOAD_BYTES // 2**20} MiB one message carries; cut the "
                    f"model into more fragments (--fragments, at least {at_least})"
                )

    @classmethod
    def for_model(
        cls, model: torch.nn.Module, num_fragments: int, sync_every: int | None = None
    ) -> FragmentPlan:
        return cls.build(param_specs(synced_parameters(model).items()), num_fragments, sync_every)

    # -- structure -------------------------------------------------------
    def fragment_specs(self, fragment: int) -> list[ParamSpec]:
        """The fragment's parameters, in model order (the flattening order)."""
        return [s for s, p in zip(self.specs, self.owner, strict=True) if p == fragment]

    def fragment_numel(self, fragment: int) -> int:
        return sum(s.numel for s in self.fragment_specs(fragment))

    def fragment_nbytes(self, fragment: int) -> int:
        return sum(s.nbytes for s in self.fragment_specs(fragment))

    @property
    def total_numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def max_message_bytes(self) -> int:
        """The largest frame a message of this plan can need: its largest fragment
        in fp32 (the widest codec) plus the largest header. Transports refuse
        anything bigger before decoding it."""
        widest = max(self.fragment_numel(p) for p in range(self.num_fragments))
        return 4 * widest + MAX_HEADER_BYTES + FRAME_PREFIX_BYTES

    def to_json(self) -> dict[str, Any]:
        """The whole plan as plain JSON values (what :meth:`from_json` reads)."""
        return {
            "fragments": self.num_fragments,
            "sync_every": self.sync_every,
            "params": [
                [s.name, list(s.shape), s.dtype, p]
                for s, p in zip(self.specs, self.owner, strict=True)
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> FragmentPlan:
        """A plan written by :meth:`to_json`; ``ValueError`` if it is not one."""
        try:
            num_fragments, sync_every = int(data["fragments"]), int(data["sync_every"])
            rows = [
                (str(n), tuple(int(d) for d in shape), str(dt), int(p))
                for n, shape, dt, p in data["params"]
            ]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"not a fragment plan: {e!r}") from None
        specs = tuple(ParamSpec(n, shape, dt) for n, shape, dt, _ in rows)
        owner = tuple(p for *_, p in rows)
        for spec in specs:
            if not isinstance(getattr(torch, spec.dtype, None), torch.dtype):
                raise ConfigError(f"not a fragment plan: unknown dtype {spec.dtype!r}")
        if num_fragments < 1 or sync_every < 1 or sync_every % num_fragments:
            raise ConfigError(f"not a fragment plan: P={num_fragments}, H={sync_every}")
        if len({s.name for s in specs}) != len(specs) or set(owner) != set(range(num_fragments)):
            raise ConfigError("not a fragment plan: duplicate names or an empty fragment")
        plan = cls(specs, owner, num_fragments, sync_every)
        plan.check_fp32_fits()
        return plan

    @property
    def plan_hash(self) -> str:
        """16 hex digits identifying the plan; equal plans hash equal everywhere."""
        canonical = json.dumps(self.to_json(), separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    # -- schedule --------------------------------------------------------
    def offset(self, fragment: int) -> int:
        """t_p: fragment p syncs at the steps t > 0 with t mod H == t_p."""
        return fragment * self.sync_every // self.num_fragments

    def fragments_due(self, step: int) -> list[int]:
        if step <= 0:
            return []
        phase = step % self.sync_every
        return [p for p in range(self.num_fragments) if self.offset(p) == phase]

    # -- tensors ---------------------------------------------------------
    def flatten(self, params: Mapping[str, torch.Tensor], fragment: int) -> torch.Tensor:
        """The fragment as one flat fp32 CPU vector (a copy)."""
        parts = [
            params[s.name].detach().reshape(-1).to("cpu", torch.float32)
            for s in self.fragment_specs(fragment)
        ]
        return torch.cat(parts) if parts else torch.empty(0)

    def unflatten(self, flat: torch.Tensor, fragment: int) -> dict[str, torch.Tensor]:
        """Split a flat vector back into the fragment's named tensors (fp32 views)."""
        expected = self.fragment_numel(fragment)
        if flat.ndim != 1 or flat.numel() != expected:
            # Callers check sizes first (a global's numel against the plan): a bug.
            raise ConfigError(
                f"fragment {fragment} has {expected} elements, got shape {tuple(flat.shape)}"
            )
        out: dict[str, torch.Tensor] = {}
        start = 0
        for s in self.fragment_specs(fragment):
            out[s.name] = flat[start : start + s.numel].view(s.shape)
            start += s.numel
        return out
