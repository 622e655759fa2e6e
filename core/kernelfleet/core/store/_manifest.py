"""The manifest of an uploaded directory (a checkpoint): every file with its size and sha256.

It is written after every file, so its presence means the directory is complete, and it
carries the checksums that a download verifies. It holds no timestamps: uploading the same
directory again produces the same manifest, which keeps the upload idempotent and resumable.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_NAME = "_MANIFEST.json"


class ManifestEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(description="Relative path inside the directory, '/'-separated.")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class DirManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["kernelfleet.dir/v1"] = "kernelfleet.dir/v1"
    files: tuple[ManifestEntry, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.files)
