"""Chat Markdown, one home for the desktop window (ui/markdown.py) and the web page
(``POST /mixdesk/markdown``, core/http/webui.py). Qt-free.

markdown-it-py (CommonMark, tables, strikethrough) with raw HTML disabled: user and
model text are never interpreted as HTML (a "<script>" or an "<img onerror=...>"
shows as typed, escaped), and links with a script/data/file scheme are not links
(markdown-it's own validateLink). Code blocks are cut out of the token stream and
drawn by the caller's ``code_block(code, lang)``: the desktop draws Qt's rich-text
subset with inline styles, the page ``<pre><code>`` with pygments classes.

A reply that is still streaming renders the same way: an unclosed fence is a code
block up to the end, so the text does not jump when the reply finishes.
"""

from __future__ import annotations

import html
from collections.abc import Callable

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

CodeBlock = Callable[[str, str], str]  # (code, language) -> HTML
WEB_LIGHT_STYLE = "friendly"
WEB_DARK_STYLE = "monokai"
WEB_CODE_SCOPE = ".md pre.code"  # where the page's pygments classes apply


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])


_MD = _parser()


def render_with(text: str, code_block: CodeBlock) -> str:
    """``text``'s Markdown as HTML, each fenced or indented code block drawn by
    ``code_block(code, lang)`` (``lang``: the fence's first word, or "")."""
    tokens = _MD.parse(text)
    blocks = []
    for i, tok in enumerate(tokens):
        if tok.type in ("fence", "code_block"):
            lang = tok.info.strip().split(" ")[0] if tok.info else ""
            blocks.append(code_block(tok.content, lang))
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


def lexer_for(lang: str) -> Lexer | None:
    """pygments' lexer for a fence's language name, or None (unknown or none given)."""
    if not lang:
        return None
    try:
        return get_lexer_by_name(lang)
    except ClassNotFound:
        return None


# ---- the web page -------------------------------------------------------------------------

_WEB_FORMATTER = HtmlFormatter(nowrap=True)  # classes ("k", "s2", ...), styled by web_css()


def web_code_block(code: str, lang: str) -> str:
    """A code block of the page: ``<pre class="code"><code>`` with pygments' classes
    (unknown languages escaped, unhighlighted); the language is a data attribute."""
    lexer = lexer_for(lang)
    if lexer is not None:
        body = highlight(code, lexer, _WEB_FORMATTER).rstrip("\n")
    else:
        body = html.escape(code.rstrip("\n"))
    attr = f' data-lang="{html.escape(lang, quote=True)}"' if lang else ""
    return f'<pre class="code"{attr}><code>{body}</code></pre>\n'


def web_html(text: str) -> str:
    """One reply's Markdown as the page shows it."""
    return render_with(text, web_code_block)


def web_css() -> str:
    """The pygments classes' colours for the page, light and dark (the page follows
    the browser's prefers-color-scheme), scoped to its code blocks: the style's
    background and token rules only (no global ``pre`` or line-number rules)."""

    def rules(style: str) -> str:
        fmt = HtmlFormatter(style=style)
        return "\n".join(
            [
                *fmt.get_background_style_defs(WEB_CODE_SCOPE),
                *fmt.get_token_style_defs(WEB_CODE_SCOPE),
            ]
        )

    dark = rules(WEB_DARK_STYLE)
    return f"{rules(WEB_LIGHT_STYLE)}\n@media (prefers-color-scheme: dark) {{\n{dark}\n}}\n"
