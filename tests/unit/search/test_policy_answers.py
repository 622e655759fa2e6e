"""Parsing answers the way models really write them: a corpus of messy, realistic answers."""

from __future__ import annotations

import pytest

from kernelfleet.search import check_code, parse_answer

CODE = """import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return a.unsqueeze(1) * b
"""

CUDA = """__global__ void scale(const float* a, const float* b, float* out, int n, int m) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * m) out[i] = a[i / m] * b[i];
}"""

LOAD_INLINE = '''import torch
from torch.utils.cpp_extension import load_inline

source = """
#include <torch/extension.h>
torch::Tensor scale(torch::Tensor a, torch::Tensor b) { return a.unsqueeze(1) * b; }
"""
module = load_inline(name="scale", cpp_sources=source, functions=["scale"])


class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return module.scale(a, b)
'''


def test_the_canonical_three_sections() -> None:
    text = (
        "## Performance Analysis\nVariant 2 avoids materialising diag(a).\n\n"
        "## Algorithm Design\nBroadcast a over the rows of b.\n\n"
        f"## Code Implementation\n```python\n{CODE}```\n"
    )
    parsed = parse_answer(text)
    assert parsed.ok and parsed.code == CODE
    assert parsed.analysis.startswith("Variant 2 avoids")
    assert parsed.design == "Broadcast a over the rows of b."
    assert parsed.missing_sections == ()


@pytest.mark.parametrize(
    "heading",
    [
        "**Performance Analysis**",
        "### 1. Performance Analysis:",
        "1) Performance analysis",
        "PERFORMANCE ANALYSIS:",
        "**1. Performance Analysis:**",
        "# Analysis",
    ],
)
def test_heading_styles(heading: str) -> None:
    text = f"{heading}\nMemory bound.\n\n**Algorithm Design**\nFuse.\n\n**Code Implementation**\n"
    text += f"```py\n{CODE}```"
    parsed = parse_answer(text)
    assert parsed.ok
    assert parsed.analysis == "Memory bound."
    assert parsed.design == "Fuse."


@pytest.mark.parametrize("fence", ["```", "~~~", "````"])
@pytest.mark.parametrize("lang", ["python", "py", "Python3", "", "pytorch"])
def test_fences_and_languages(fence: str, lang: str) -> None:
    parsed = parse_answer(f"Here you go:\n{fence}{lang}\n{CODE}{fence}\nDone.")
    assert parsed.code == CODE
    assert set(parsed.missing_sections) == {"analysis", "design", "code"}


def test_no_sections_at_all_still_gives_the_code() -> None:
    parsed = parse_answer(f"```python\n{CODE}```")
    assert parsed.ok and parsed.missing_sections == ("analysis", "design", "code")


def test_several_blocks_picks_the_one_with_model_new() -> None:
    text = (
        "## Performance Analysis\nThe kernel:\n"
        f"```cuda\n{CUDA}\n```\n"
        "Usage example:\n```python\nx = torch.randn(4)\nprint(x)\n```\n"
        f"## Code Implementation\n```python\n{LOAD_INLINE}```\n"
        "And a shell command:\n```bash\npython run.py\n```\n"
    )
    parsed = parse_answer(text)
    assert parsed.code == LOAD_INLINE


def test_a_refined_second_version_wins() -> None:
    second = CODE.replace("a.unsqueeze(1) * b", "b * a[:, None]")
    text = f"First attempt:\n```python\n{CODE}```\nActually, better:\n```python\n{second}```\n"
    assert parse_answer(text).code == second


def test_reasoning_in_think_tags_is_ignored() -> None:
    draft = CODE.replace("a.unsqueeze(1) * b", "torch.diag(a) @ b  # draft")
    text = f"<think>Maybe:\n```python\n{draft}```\nno, broadcast.</think>\n```python\n{CODE}```"
    assert parse_answer(text).code == CODE


def test_unclosed_think_is_dropped_and_the_answer_has_no_code() -> None:
    parsed = parse_answer(f"<think>Let me consider\n```python\n{CODE}")
    # Everything after an unclosed <think> is reasoning: the visible answer is empty, so the
    # parser falls back to the whole text rather than inventing nothing.
    assert parsed.ok


def test_a_headline_comment_inside_code_is_not_a_section() -> None:
    code = "# Code\nimport torch\n\n\nclass ModelNew(torch.nn.Module):\n"
    code += "    def forward(self, x):\n        return x\n"
    text = (
        f"## Performance Analysis\nA.\n## Algorithm Design\nB.\n## Code Implementation\n```python\n{code}```"
    )
    parsed = parse_answer(text)
    assert parsed.code == code
    assert parsed.design == "B."


def test_code_without_fences() -> None:
    text = f"Performance Analysis: memory bound.\n\n{CODE}\nThis should be about 10x faster."
    parsed = parse_answer(text)
    assert parsed.ok
    assert "class ModelNew" in (parsed.code or "")
    assert "10x faster" not in (parsed.code or "")


def test_truncated_inside_the_code_block() -> None:
    cut = CODE[: CODE.index("return")] + "return a.unsqueeze(1"
    parsed = parse_answer(f"## Code Implementation\n```python\n{cut}")
    assert not parsed.ok
    assert "cut off" in parsed.error


def test_a_complete_block_that_does_not_parse() -> None:
    parsed = parse_answer("```python\nclass ModelNew(:\n    pass\n```")
    assert not parsed.ok and parsed.error.startswith("code does not parse")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty answer"),
        ("   \n  ", "empty answer"),
        ("I cannot help with that.", "no code in the answer"),
        ("```python\nimport torch\nx = 1\n```", "no code block defines class ModelNew"),
        (f"```cuda\n{CUDA}\n```", "no code block defines class ModelNew"),
    ],
)
def test_unusable_answers_say_why(text: str, reason: str) -> None:
    parsed = parse_answer(text)
    assert parsed.code is None
    assert parsed.error == reason


def test_model_new_in_a_block_tagged_with_another_language() -> None:
    parsed = parse_answer(f"```cpp\n{LOAD_INLINE}```")
    assert parsed.code == LOAD_INLINE


def test_windows_line_endings() -> None:
    text = f"## Code Implementation\r\n```python\r\n{CODE}```\r\n".replace("\n", "\r\n").replace("\r\r", "\r")
    parsed = parse_answer(text)
    assert parsed.ok
    assert "class ModelNew" in (parsed.code or "") and "\r" not in (parsed.code or "")


def test_check_code() -> None:
    assert check_code(CODE) == ""
    assert check_code("import torch\n") == "the code does not define class ModelNew"
    assert check_code("class ModelNew(:\n").startswith("code does not parse")
