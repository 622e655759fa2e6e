"""torch's extension loaders in a candidate's process: stable names, remembered failed builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernelfleet.evaluator import _extensions as E

COMPILER_ERROR = (
    "Error building extension 'ext': [1/3] c++ -c main.cpp -o main.o\n"
    "main.cpp:4:1: error: 'fast_gelu_kernel' was not declared in this scope\n"
    "ninja: build stopped: subcommand failed."
)
KILLED = "Error building extension 'ext': c++: fatal error: Killed signal terminated program cc1plus"


def test_the_process_id_in_a_name_becomes_pid() -> None:
    assert E.stable_name("huber_loss_cuda_4242", pid=4242) == "huber_loss_cuda_pid"
    assert E.stable_name("ext_4242_v2", pid=4242) == "ext_pid_v2"


def test_other_numbers_stay() -> None:
    assert E.stable_name("conv2d_14242", pid=4242) == "conv2d_14242"
    assert E.stable_name("conv2d_42421", pid=4242) == "conv2d_42421"
    assert E.stable_name("fused_relu", pid=4242) == "fused_relu"


def test_only_the_compilers_verdict_is_repeatable() -> None:
    assert E.repeatable_failure(COMPILER_ERROR)
    assert E.repeatable_failure('cuda.cu(12): error: identifier "x" is undefined')
    assert not E.repeatable_failure(KILLED)
    assert not E.repeatable_failure("Error building extension 'ext': No space left on device")
    assert not E.repeatable_failure("Error building extension 'ext': ninja: interrupted by user.")


class CountingLoader:
    def __init__(self, message: str) -> None:
        self.calls: list[str] = []
        self.message = message

    def __call__(self, name: str, cpp_sources: str = "", **_: Any) -> Any:
        self.calls.append(name)
        raise RuntimeError(self.message)


def test_a_failed_build_fails_again_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    load = CountingLoader(COMPILER_ERROR)
    wrapped = E._shared_build_loader(load)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="was not declared"):
            wrapped(name="ext", cpp_sources="int f();")
    assert len(load.calls) == 1
    with pytest.raises(RuntimeError):
        wrapped(name="ext", cpp_sources="int g();")  # other sources: built (and failed) afresh
    assert len(load.calls) == 2


def test_a_failure_that_may_not_repeat_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    load = CountingLoader(KILLED)
    wrapped = E._shared_build_loader(load)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Killed"):
            wrapped("ext", "int f();")
    assert len(load.calls) == 2


def test_the_key_covers_source_files(tmp_path: Path) -> None:
    source = tmp_path / "k.cu"
    source.write_text("one")
    first = E.build_key(("ext", [str(source)]), {})
    source.write_text("two")
    assert E.build_key(("ext", [str(source)]), {}) != first
