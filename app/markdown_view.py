"""An answer's Markdown as the HTML the chat view shows: CommonMark with tables and strikethrough (markdown-it-py),
code blocks highlighted by Pygments under a bar with their language and a Copy link.

The text is a model's output, so it is not trusted: raw HTML in it is shown as text, never rendered, and links are
kept only for the schemes `OPEN_SCHEMES` (the view opens them in the browser); `copy:N` links are ours. A fence
still open while the answer streams renders as a code block up to the end, so a block does not jump from plain text
to code when its closing fence arrives. No Qt here (the view, app.chat_view, sets the HTML).
"""

from __future__ import annotations

import html
from functools import lru_cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.util import ClassNotFound

COPY_SCHEME = "copy"  # href="copy:N": the view copies code block N
OPEN_SCHEMES = ("http", "https", "mailto")
# theme -> (Pygments style, the bar over a block, the bar's text colour, a table's border colour)
THEMES = {"light": ("default", "#e8ebef", "#57606a", "#c8ccd0"),
          "dark": ("monokai", "#3a3b35", "#c8c8c0", "#55564f")}
MAX_HIGHLIGHT_CHARS = 200_000  # longer blocks are shown as plain text (Pygments on megabytes would stall the UI)


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
    md.validateLink = lambda url: url.split(":", 1)[0].lower() in OPEN_SCHEMES if ":" in url else False
    return md


def _lexer(language: str):
    if not language:
        return None
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


def _code_html(code: str, language: str, index: int, theme: str) -> str:
    style_name, bar, bar_text, _ = THEMES[theme]
    style = get_style_by_name(style_name)
    lexer = _lexer(language) if len(code) <= MAX_HIGHLIGHT_CHARS else None
    if lexer is None:
        body = html.escape(code)
        colour = "#f8f8f2" if theme == "dark" else "#1f2328"
        body = f'<span style="color:{colour}">{body}</span>'
    else:
        body = highlight(code, lexer, HtmlFormatter(noclasses=True, nowrap=True, style=style_name))
    label = html.escape(language) if language else "code"
    return (f'<table width="100%" cellspacing="0" cellpadding="6" style="margin-top:6px; margin-bottom:6px">'
            f'<tr><td style="background-color:{bar}; color:{bar_text}">{label}</td>'
            f'<td align="right" style="background-color:{bar}"><a href="{COPY_SCHEME}:{index}" '
            f'style="color:{bar_text}">Copy</a></td></tr>'
            f'<tr><td colspan="2" style="background-color:{style.background_color}">'
            f'<pre style="margin:0">{body}</pre></td></tr></table>\n')


def render(text: str, theme: str) -> tuple[str, list[str]]:
    """(the HTML of `text`, the text of each code block in order: what its Copy link copies). `theme`: "light" or
    "dark" (the resolved theme, app.theme)."""
    blocks: list[str] = []
    md = _parser()
    tokens = md.parse(text)
    out = []
    pieces: list = []

    def flush() -> None:
        if pieces:
            out.append(md.renderer.render(pieces, md.options, {}))
            pieces.clear()

    for token in tokens:
        if token.type in ("fence", "code_block"):
            flush()
            language = token.info.strip().split()[0] if token.type == "fence" and token.info.strip() else ""
            out.append(_code_html(token.content, language, len(blocks), theme))
            blocks.append(token.content)
        else:
            pieces.append(token)
    flush()
    border = THEMES[theme][3]
    page = "".join(out).replace("<table>", f'<table border="1" cellspacing="0" cellpadding="4" '
                                           f'style="border-color:{border}">')
    return page, blocks
