"""Each image installs only the components it should: the operator image never sees the GPU
stack, the worker has torch but no vLLM, the trainer has everything. No Docker engine runs in
CI, so the Dockerfiles are checked as text, instruction by instruction (comments ignored)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
IMAGES = ROOT / "images"
COMPONENTS = {"core", "evaluator", "search", "trainer", "operator"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, arguments = line.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    assert not pending, f"{path}: a continued line never ends"
    return result


def copied_components(path: Path) -> set[str]:
    """The repository folders that COPY instructions take from the build context."""
    copied: set[str] = set()
    for keyword, arguments in instructions(path):
        if keyword == "COPY" and "--from=" not in arguments:
            *sources, _ = arguments.split()
            copied.update(source.strip("./") for source in sources)
    return copied


def text_of(path: Path) -> str:
    return "\n".join(f"{k} {a}" for k, a in instructions(path))


def test_operator_image_installs_core_and_operator_only_and_no_gpu_stack() -> None:
    dockerfile = IMAGES / "operator" / "Dockerfile"
    assert copied_components(dockerfile) == {"core", "operator"}
    text = text_of(dockerfile)
    for word in ("evaluator", "search", "trainer", "torch", "cuda", "vllm", "transformers", "trl"):
        assert not re.search(rf"\b{word}\b", text, re.IGNORECASE), word
    assert re.search(r"^FROM python:3\.11-slim|PYTHON_IMAGE=python:3\.11-slim", text, re.MULTILINE)


def test_worker_image_has_torch_and_no_vllm_and_no_operator() -> None:
    dockerfile = IMAGES / "worker" / "Dockerfile"
    assert copied_components(dockerfile) == {"core", "evaluator", "search"}
    text = text_of(dockerfile)
    assert "nvidia/cuda:" in text and "-devel-" in text  # nvcc: the evaluator compiles CUDA candidates
    assert re.search(r"pip install .*torch==", text)
    assert not re.search(r"\bvllm\b", text, re.IGNORECASE)
    assert not re.search(r"\b(kopf|operator)\b", text)


def test_trainer_image_has_vllm_and_every_component_but_the_operator() -> None:
    dockerfile = IMAGES / "trainer" / "Dockerfile"
    assert copied_components(dockerfile) == {"core", "evaluator", "search", "trainer"}
    text = text_of(dockerfile)
    assert "nvidia/cuda:" in text
    assert re.search(r"pip install .*\bvllm\b", text)
    assert not re.search(r"\b(kopf|operator)\b", text)


@pytest.mark.parametrize("image", ["operator", "worker", "trainer"])
def test_every_image_runs_as_an_unprivileged_user_and_is_multi_stage(image: str) -> None:
    steps = instructions(IMAGES / image / "Dockerfile")
    users = [arguments for keyword, arguments in steps if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert sum(keyword == "FROM" for keyword, _ in steps) >= 2
    # Component sources go to a build stage; the kernelfleet packages are never installed editable.
    assert not any(
        "-e " in arguments or "--editable" in arguments for keyword, arguments in steps if keyword == "RUN"
    )


def test_the_build_context_is_only_the_component_folders() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    included = {p.removeprefix("!").strip("/") for p in patterns if p.startswith("!")}
    assert included == COMPONENTS
    for component in COMPONENTS:
        assert (ROOT / component / "pyproject.toml").is_file(), component
