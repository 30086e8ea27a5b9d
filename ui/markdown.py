"""Chat Markdown -> the HTML subset Qt's rich text shows, without Qt.

markdown-it-py (CommonMark, tables, strikethrough) with raw HTML disabled: user and
model text are never interpreted as HTML (a "<font color=red>" or an "<img>"
shows as typed). Code blocks are highlighted by pygments with inline styles, wrap
their long lines (the transcript never scrolls sideways), and carry a Copy link
(``copy:code:KEY.N``; the texts are collected in a list the caller keeps).

A reply that is still streaming renders the same way: an unclosed fence is a code
block up to the end, so the text does not jump when the reply finishes.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound


@dataclass(frozen=True)
class Colors:
    """Taken from the window's palette (light or dark), never hard-coded to one."""

    code_bg: str = "#eef1f8"
    muted: str = "#6b7280"
    dark: bool = False
    text: str = "#1f2330"  # the body text: the ‹ › buttons' arrows

    @property
    def pygments_style(self) -> str:
        return "monokai" if self.dark else "friendly"


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])


_MD = _parser()


def render(text: str, colors: Colors, codes: list[str], key: str = "") -> str:
    """One message's Markdown as HTML; its code blocks are appended to ``codes``, and
    their Copy links are ``copy:code:{key}.{index in codes}``."""
    tokens = _MD.parse(text)
    blocks = []
    for i, tok in enumerate(tokens):
        if tok.type in ("fence", "code_block"):
            lang = tok.info.strip().split(" ")[0] if tok.info else ""
            blocks.append(code_block(tok.content, lang, colors, codes, key))
            tokens[i] = tok.copy(type="mixdesk_code", hidden=True)
    return _splice(tokens, blocks)


def _splice(tokens, blocks: list[str]) -> str:
    """Render token runs between code blocks, with the blocks' HTML in between."""
    out, run, k = [], [], 0
    for tok in tokens:
        if tok.type == "mixdesk_code":
            if run:
                out.append(_MD.renderer.render(run, _MD.options, {}))
                run = []
            out.append(blocks[k])
            k += 1
        else:
            run.append(tok)
    if run:
        out.append(_MD.renderer.render(run, _MD.options, {}))
    return "".join(out)


def code_block(code: str, lang: str, colors: Colors, codes: list[str], key: str = "") -> str:
    n = len(codes)
    codes.append(code)
    try:
        lexer = get_lexer_by_name(lang) if lang else None
    except ClassNotFound:
        lexer = None
    if lexer is not None:
        fmt = HtmlFormatter(nowrap=True, noclasses=True, style=colors.pygments_style)
        body = highlight(code, lexer, fmt).rstrip("\n")
    else:
        body = html.escape(code.rstrip("\n"))
    label = html.escape(lang) if lang else "code"
    return (
        f'<table width="100%" cellspacing="0" cellpadding="6" bgcolor="{colors.code_bg}">'
        f'<tr><td><span style="color:{colors.muted}; font-size:small">{label}</span>'
        f'&nbsp;&nbsp;<a href="copy:code:{key}.{n}" style="font-size:small">Copy</a>'
        f'<pre style="white-space:pre-wrap; margin:0">{body}</pre></td></tr></table>'
    )
