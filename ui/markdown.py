"""Chat Markdown -> the HTML subset Qt's rich text shows, without Qt.

The Markdown itself lives in core/markdown.py, shared with the web page: markdown-it-py
(CommonMark, tables, strikethrough) with raw HTML disabled, so user and model text are
never interpreted as HTML (a "<font color=red>" or an "<img>" shows as typed). This
module draws the desktop's code blocks: highlighted by pygments with inline styles,
their long lines wrapped (the transcript never scrolls sideways), with a Copy link
(``copy:code:KEY.N``; the texts are collected in a list the caller keeps).

A reply that is still streaming renders the same way: an unclosed fence is a code
block up to the end, so the text does not jump when the reply finishes.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from pygments import highlight
from pygments.formatters import HtmlFormatter

from core.markdown import lexer_for, render_with


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


def render(text: str, colors: Colors, codes: list[str], key: str = "") -> str:
    """One message's Markdown as HTML; its code blocks are appended to ``codes``, and
    their Copy links are ``copy:code:{key}.{index in codes}``."""
    return render_with(text, lambda code, lang: code_block(code, lang, colors, codes, key))


def code_block(code: str, lang: str, colors: Colors, codes: list[str], key: str = "") -> str:
    n = len(codes)
    codes.append(code)
    lexer = lexer_for(lang)
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
