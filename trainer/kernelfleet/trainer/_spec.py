"""Reading a training configuration: the TrainingRun spec's shape, from YAML or JSON.

A local `kernelfleet train run CONFIG` and a cluster TrainingRun read the same file: either a
whole TrainingRun manifest (apiVersion, kind, metadata, spec) or only its spec. The run's name
comes from `metadata.name`, else from the file's name.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kernelfleet.core.errors import UsageError
from kernelfleet.core.resources import (
    PolicyKind,
    PolicySpec,
    StageType,
    TrainingRunSpec,
    TrainingStage,
)

_NAME = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class RunConfig:
    """A named training run: its spec and where it came from."""

    name: str
    spec: TrainingRunSpec
    origin: str = ""

    @property
    def fingerprint(self) -> str:
        """A short hash of the spec: a changed spec is a new local run, never a resumed one."""
        text = json.dumps(self.spec.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def stage(self, name: str) -> TrainingStage:
        for stage in self.spec.stages:
            if stage.name == name:
                return stage
        names = ", ".join(stage.name for stage in self.spec.stages)
        raise UsageError(f"the run {self.name} has no stage {name!r}; its stages are: {names}")

    def previous(self, name: str) -> TrainingStage | None:
        """The stage before `name`, whose model `name` starts from (None: the base model)."""
        names = [stage.name for stage in self.spec.stages]
        index = names.index(self.stage(name).name)
        return self.spec.stages[index - 1] if index > 0 else None


def default_prefix(config: RunConfig) -> str:
    """Where a local run lives: derived from its name and spec, so the same config resumes."""
    return f"trainingruns/local/{config.name}/{config.fingerprint}"


def slug(text: str) -> str:
    return _NAME.sub("-", text.lower()).strip("-")[:40] or "run"


def parse_spec(data: dict[str, Any], origin: str, default_name: str) -> RunConfig:
    """A RunConfig from a manifest or a bare spec, as a dict."""
    name = default_name
    if "spec" in data and isinstance(data["spec"], dict):
        kind = data.get("kind", "TrainingRun")
        if kind != "TrainingRun":
            raise UsageError(f"{origin} is a {kind}, not a TrainingRun")
        metadata = data.get("metadata") or {}
        name = str(metadata.get("name") or default_name)
        data = data["spec"]
    try:
        spec = TrainingRunSpec.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:5])
        raise UsageError(f"{origin} is not a valid TrainingRun spec: {problems}") from None
    names = [stage.name for stage in spec.stages]
    if len(set(names)) != len(names):
        raise UsageError(f"{origin}: stage names must be unique, got {names}")
    return RunConfig(slug(name), spec, origin)


def load_run_config(path: str | Path) -> RunConfig:
    """Read CONFIG (.yaml, .yml or .json)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read the training config {file}: {error}") from None
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"{file} is not valid JSON: {error}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise UsageError(f"{file} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{file} must hold a TrainingRun manifest or spec (a mapping)")
    return parse_spec(data, str(file), file.stem)


def policy_string(spec: PolicySpec) -> str:
    """The `make_policy` form of a PolicySpec."""
    if spec.kind == PolicyKind.COMPILE:
        return "compile"
    if spec.kind == PolicyKind.REPLAY:
        return f"replay:{spec.path}"
    if spec.kind == PolicyKind.OPENAI:
        return f"openai:{spec.model}@{spec.base_url}" if spec.base_url else f"openai:{spec.model}"
    return f"{spec.kind.value}:{spec.model}"


STAGE_COMMANDS = {"sft": StageType.SFT, "self-train": StageType.SELF_TRAIN, "rl": StageType.GRPO}
