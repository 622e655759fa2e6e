"""The `compile` policy: rewrites of the reference that need no model and keep its numerics.

These are the honest baselines an LLM-written kernel has to beat: `torch.compile` in its modes,
replaying the eager forward as a CUDA graph, channels-last memory format for convolutions. Each
variant is the reference module itself followed by a `ModelNew` that subclasses `Model`, so the
parameters are created exactly as the reference creates them and the evaluator's seeded
initialisation gives both the same weights. Nothing is cached across calls: the CUDA-graph
variant copies every call's inputs into its static buffers and returns a fresh copy of the
output, so it stays correct when the caller keeps outputs or changes inputs in place.

Variants are proposed in a fixed order, the ones most likely to help first, and never twice
for one task; when all applicable ones have been proposed the policy says it is exhausted.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kernelfleet.core.errors import UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Task
from kernelfleet.search.policies._base import Proposal, Request

_HEADER = "\n\n# ---- kernelfleet compile policy: {name} ----\nimport torch as _kf_torch\n\n"

_CLONE_HELPER = '''
def _kf_fresh(value):
    """A copy of every tensor in `value`: graph outputs live in buffers the next replay overwrites."""
    if isinstance(value, _kf_torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_kf_fresh(item) for item in value)
    return value

'''

_COMPILE = '''
class ModelNew(Model):
    """The reference forward under torch.compile(mode={mode!r})."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kf_forward = _kf_torch.compile(super().forward, mode={mode!r}, dynamic=False)

    def forward(self, *inputs):
        return self._kf_forward(*inputs)
'''

_COMPILE_GRAPHS = (
    _CLONE_HELPER
    + '''
class ModelNew(Model):
    """The reference forward under torch.compile(mode={mode!r}), whose CUDA graphs reuse output memory."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kf_forward = _kf_torch.compile(super().forward, mode={mode!r}, dynamic=False)

    def forward(self, *inputs):
        _kf_torch.compiler.cudagraph_mark_step_begin()
        return _kf_fresh(self._kf_forward(*inputs))
'''
)

_CUDAGRAPH = (
    _CLONE_HELPER
    + '''
def _kf_signature(inputs):
    return tuple(
        (tuple(x.shape), x.stride(), x.dtype, x.device) if isinstance(x, _kf_torch.Tensor) else repr(x)
        for x in inputs
    )


class ModelNew(Model):
    """The eager reference forward captured once per input signature as a CUDA graph and replayed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kf_graphs = {}

    def _kf_capture(self, inputs):
        static_inputs = [x.clone() if isinstance(x, _kf_torch.Tensor) else x for x in inputs]
        # Warm-up on a side stream before capture, as CUDA-graph capture requires; the
        # graph itself is replayed on the current stream.
        side = _kf_torch.cuda.Stream()
        side.wait_stream(_kf_torch.cuda.current_stream())
        with _kf_torch.cuda.stream(side):
            for _ in range(2):
                Model.forward(self, *static_inputs)
        _kf_torch.cuda.current_stream().wait_stream(side)
        graph = _kf_torch.cuda.CUDAGraph()
        with _kf_torch.cuda.graph(graph):
            static_output = Model.forward(self, *static_inputs)
        return graph, static_inputs, static_output

    def forward(self, *inputs):
        tensors = [x for x in inputs if isinstance(x, _kf_torch.Tensor)]
        if not tensors or any(not x.is_cuda for x in tensors):
            return Model.forward(self, *inputs)
        signature = _kf_signature(inputs)
        entry = self._kf_graphs.get(signature)
        if entry is None:
            entry = self._kf_capture(inputs)
            self._kf_graphs[signature] = entry
        graph, static_inputs, static_output = entry
        for static, given in zip(static_inputs, inputs):
            if isinstance(static, _kf_torch.Tensor):
                static.copy_(given)
        graph.replay()
        return _kf_fresh(static_output)
'''
)

_CHANNELS_LAST = '''
def _kf_format(x):
    if isinstance(x, _kf_torch.Tensor) and x.dim() == 4:
        return x.contiguous(memory_format=_kf_torch.channels_last)
    if isinstance(x, _kf_torch.Tensor) and x.dim() == 5:
        return x.contiguous(memory_format=_kf_torch.channels_last_3d)
    return x


def _kf_dense(value):
    if isinstance(value, _kf_torch.Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(_kf_dense(item) for item in value)
    return value


class ModelNew(Model):
    """The reference with its convolution weights and inputs in channels-last memory format."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for parameter in self.parameters():
            parameter.data = _kf_format(parameter.data)
        self._kf_forward = {forward}

    def forward(self, *inputs):
        return _kf_dense(self._kf_forward(*[_kf_format(x) for x in inputs]))
'''

_CONV = re.compile(r"\b(?:Conv(?:Transpose)?[23]d|conv(?:_transpose)?[23]d)\b")


@dataclass(frozen=True)
class CompileVariant:
    """One rewrite: its name, where it applies, and its `ModelNew` source."""

    name: str
    body: str
    gpu_only: bool = False
    applies: Callable[[Task], bool] = lambda task: True

    def render(self, task: Task) -> str:
        return task.code.rstrip() + "\n" + _HEADER.format(name=self.name) + self.body.lstrip("\n")


def _has_conv(task: Task) -> bool:
    return bool(_CONV.search(task.code))


COMPILE_DEFAULT = "compile-default"

VARIANTS: tuple[CompileVariant, ...] = (
    CompileVariant(COMPILE_DEFAULT, _COMPILE.format(mode="default")),
    CompileVariant(
        "compile-max-autotune-no-cudagraphs",
        _COMPILE.format(mode="max-autotune-no-cudagraphs"),
        gpu_only=True,
    ),
    CompileVariant("cudagraph", _CUDAGRAPH, gpu_only=True),
    CompileVariant("compile-reduce-overhead", _COMPILE_GRAPHS.format(mode="reduce-overhead"), gpu_only=True),
    CompileVariant("channels-last", _CHANNELS_LAST.format(forward="super().forward"), applies=_has_conv),
    CompileVariant(
        "channels-last-compile",
        _CHANNELS_LAST.format(forward='_kf_torch.compile(super().forward, mode="default", dynamic=False)'),
        applies=_has_conv,
    ),
)


class CompilePolicy:
    """Proposes the `VARIANTS` that apply to a task and device, each once, in order."""

    def __init__(self, variants: Sequence[CompileVariant] = VARIANTS) -> None:
        self._variants = tuple(variants)
        names = [variant.name for variant in self._variants]
        # The full set is plain "compile"; a subset gets its own id, so its samples never mix
        # with those of another subset in one run.
        full = names == [variant.name for variant in VARIANTS]
        self._id = (
            "compile" if full else "compile-" + hashlib.sha256(",".join(names).encode()).hexdigest()[:8]
        )

    @classmethod
    def only(cls, names: Sequence[str]) -> CompilePolicy:
        """The policy restricted to the named variants (in the standard order)."""
        known = {variant.name for variant in VARIANTS}
        unknown = [name for name in names if name not in known]
        if unknown or not names:
            raise UsageError(
                f"unknown compile variant(s) {', '.join(unknown) or '(none given)'}; choose from "
                + ", ".join(variant.name for variant in VARIANTS)
            )
        return cls([variant for variant in VARIANTS if variant.name in set(names)])

    @property
    def name(self) -> str:
        return "compile"

    @property
    def id(self) -> str:
        return self._id

    @property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(variant.name for variant in self._variants)

    def variants_for(self, task: Task, on_gpu: bool) -> list[tuple[str, str]]:
        """(name, code) of every variant that applies to `task` on this kind of device."""
        return [
            (variant.name, variant.render(task))
            for variant in self._variants
            if (on_gpu or not variant.gpu_only) and variant.applies(task)
        ]

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        handed_out: dict[str, set[str]] = {}
        proposals = []
        for request in requests:
            taken = handed_out.setdefault(request.task.hash, set(request.seen))
            proposal = Proposal.nothing_left()
            for name, code in self.variants_for(request.task, request.on_gpu):
                digest = source_hash(code)
                if digest not in taken:
                    taken.add(digest)
                    proposal = Proposal(
                        code=code, name=name, text=f"compile policy variant {name}", key=digest
                    )
                    break
            proposals.append(proposal)
        return proposals

    def close(self) -> None:
        return None
