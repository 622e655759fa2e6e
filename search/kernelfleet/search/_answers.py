"""Reading a policy's answer: analysis, design and the code of `ModelNew`.

Models do not answer the way prompts ask. They wrap code in ```python, ```py, ``` or ~~~
fences, or in none; they send a CUDA source in one block and the Python that loads it in
another; they refine the code once and repeat it; they think aloud in <think> tags first;
they run out of tokens inside a fence. The parser accepts all of these and picks the block
that defines `ModelNew`. An answer it cannot use comes back with a reason, so the loop can
record it without spending a second of GPU time on it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

SECTIONS = ("analysis", "design", "code")

# Headings the three sections get in practice: "## Performance Analysis", "**1. Algorithm
# Design**", "Code Implementation:", "### 3) Code". Matched on a line of its own.
_HEADING = re.compile(
    r"""^[ \t]*(?:\#{1,6}[ \t]*)?(?:\*\*|__)?[ \t]*(?:(?:\d+|[ivx]+)[.):][ \t]*)?(?:\*\*|__)?[ \t]*
        (?P<title>performance[ \t]+analysis|analysis|algorithm[ \t]+design|design|
           code[ \t]+implementation|implementation|code)
        [ \t]*(?:\*\*|__)?[ \t]*:?[ \t]*(?:\*\*|__)?[ \t]*$""",
    re.IGNORECASE | re.MULTILINE | re.VERBOSE,
)
_FENCE_OPEN = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n]*$", re.MULTILINE)
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)
_MODEL_NEW = re.compile(r"^[ \t]*class[ \t]+ModelNew\b", re.MULTILINE)
_PYTHON_LANGS = {"", "python", "py", "python3", "py3", "pytorch", "torch"}
_CODE_START = re.compile(r"^(?:import |from \S+ import |class |def |@|[A-Za-z_]\w*[ \t]*=)", re.MULTILINE)


@dataclass(frozen=True)
class CodeBlock:
    lang: str
    text: str
    closed: bool
    start: int
    end: int


@dataclass(frozen=True)
class ParsedAnswer:
    """What was read from one answer. `code` is None exactly when `error` says why."""

    code: str | None
    analysis: str
    design: str
    error: str
    missing_sections: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.code is not None


def code_blocks(text: str) -> list[CodeBlock]:
    """Every fenced block in order; an unclosed last fence runs to the end of the text."""
    blocks: list[CodeBlock] = []
    position = 0
    while True:
        opening = _FENCE_OPEN.search(text, position)
        if opening is None:
            return blocks
        fence = opening.group("fence")
        body_start = opening.end() + 1
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", re.MULTILINE)
        match = closing.search(text, body_start)
        lang = opening.group("lang").lower()
        if match is None:
            blocks.append(CodeBlock(lang, text[body_start:], False, opening.start(), len(text)))
            return blocks
        blocks.append(CodeBlock(lang, text[body_start : match.start()], True, opening.start(), match.end()))
        position = match.end()


def _sections(text: str, blocks: list[CodeBlock]) -> dict[str, str]:
    """Text under each recognised heading by section; a `# Code` comment inside a fence is no heading."""
    headings = []
    for match in _HEADING.finditer(text):
        if any(block.start <= match.start() < block.end for block in blocks):
            continue
        title = match.group("title").lower()
        key = "analysis" if "analysis" in title else "design" if "design" in title else "code"
        headings.append((match.start(), match.end(), key))
    found: dict[str, str] = {}
    for index, (_start, end, key) in enumerate(headings):
        stop = headings[index + 1][0] if index + 1 < len(headings) else len(text)
        if key not in found:
            found[key] = text[end:stop].strip()
    return found


def _syntax_error(code: str) -> str:
    try:
        ast.parse(code)
    except SyntaxError as error:
        return f"line {error.lineno}: {error.msg}"
    except ValueError as error:  # null bytes
        return str(error)
    return ""


def check_code(code: str) -> str:
    """Why `code` cannot be a variant (no `ModelNew`, a syntax error), or "" when it can."""
    if not _MODEL_NEW.search(code):
        return "the code does not define class ModelNew"
    error = _syntax_error(code)
    return f"code does not parse ({error})" if error else ""


def _unfenced_code(text: str) -> str | None:
    """Code written without fences: from the first code-looking line to the end, if it parses."""
    if not _MODEL_NEW.search(text):
        return None
    start = _CODE_START.search(text)
    if start is None:
        return None
    lines = text[start.start() :].split("\n")
    # Prose after the code is common ("This should be faster because..."): drop trailing lines
    # until what is left parses.
    for end in range(len(lines), 0, -1):
        candidate = "\n".join(lines[:end]).strip() + "\n"
        if _MODEL_NEW.search(candidate) and not _syntax_error(candidate):
            return candidate
    return None


def parse_answer(text: str) -> ParsedAnswer:
    """Read the analysis, the design and the `ModelNew` code from one answer."""
    if not text or not text.strip():
        return ParsedAnswer(None, "", "", "empty answer", SECTIONS)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    visible = _THINK.sub("", text).strip() or text
    blocks = code_blocks(visible)
    sections = _sections(visible, blocks)
    missing = tuple(name for name in SECTIONS if name not in sections)
    analysis = sections.get("analysis", "")
    design = sections.get("design", "")

    def answer(code: str | None, error: str = "") -> ParsedAnswer:
        return ParsedAnswer(code, analysis, design, error, missing)

    python_blocks = [block for block in blocks if block.lang in _PYTHON_LANGS]
    with_model = [block for block in python_blocks if _MODEL_NEW.search(block.text)]
    if not with_model:
        # A ModelNew inside a block tagged with another language (```cuda holding Python) or
        # outside any fence.
        with_model = [block for block in blocks if _MODEL_NEW.search(block.text)]
    if not with_model:
        unfenced = _unfenced_code(visible) if not blocks or not python_blocks else None
        if unfenced is not None:
            return answer(unfenced)
        if not blocks and not _MODEL_NEW.search(visible):
            return answer(None, "no code in the answer")
        return answer(None, "no code block defines class ModelNew")
    # Models that refine their code repeat it: the last complete block is the final word.
    complete = [block for block in with_model if block.closed]
    chosen = complete[-1] if complete else with_model[-1]
    code = chosen.text.strip("\n") + "\n"
    error = _syntax_error(code)
    if error:
        if not chosen.closed:
            return answer(None, f"answer cut off inside the code block ({error})")
        return answer(None, f"code does not parse ({error})")
    return answer(code)
