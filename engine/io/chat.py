"""Chat templates: `{"messages": [...]}` records rendered as transformers' `apply_chat_template`
renders them (the Jinja template of tokenizer_config.json, or chat_template.jinja beside
it), in the same sandbox: trim_blocks, lstrip_blocks, loop controls, the `generation` tag,
`tojson` without HTML escapes, `raise_exception`, `strftime_now`, and the special tokens of
tokenizer_config.json as variables.

`ChatTemplate.render(messages)` gives the text and the character spans of the assistant
turns: the template's `{% generation %}` blocks where it has them (transformers'
`return_assistant_tokens_mask`), else each assistant message's own text, found as the
difference between the conversation rendered up to it (with the generation prompt) and up
to its end.  Jinja is an optional dependency (the `chat` extra): it is imported when a
messages record is first met.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Optional

from memengine.engine.errors import MemengineError
from memengine.engine.io.inputs import read_json, read_small

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _token_text(v) -> Optional[str]:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def find_template(tokenizer_dir: Path) -> tuple[Optional[str], dict]:
    """(the chat template, the special tokens by name) of a tokenizer directory."""
    cfg_file = Path(tokenizer_dir) / "tokenizer_config.json"
    cfg = read_json(cfg_file, "tokenizer config") if os.path.lexists(cfg_file) else {}
    cfg = cfg if isinstance(cfg, dict) else {}
    specials = {k: t for k in SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
    jinja_file = Path(tokenizer_dir) / TEMPLATE_FILE
    if os.path.lexists(jinja_file):
        return read_small(jinja_file, "chat template").decode("utf-8", errors="replace"), specials
    t = cfg.get("chat_template")
    if isinstance(t, list):  # named templates: transformers takes "default"
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    return (t if isinstance(t, str) else None), specials


def _environment():
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:  # pragma: no cover - the chat extra
        raise MemengineError("a {\"messages\": ...} record needs the 'jinja2' package for the chat template "
                             "(pip install 'memengine[chat]')") from None

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: where the assistant's tokens are."""
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(chat_tracker=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            rv = caller()
            tracker = self.environment.chat_tracker
            if tracker is not None:
                blocks, spans = tracker
                start = len("".join(blocks))
                spans.append((start, start + len(rv)))
            return rv

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    def __init__(self, source: str, specials: dict, where: str):
        self.source = source
        self.specials = dict(specials)
        self.where = where
        env = _environment()
        try:
            self.template = env.from_string(source)
        except Exception as e:
            raise MemengineError(f"the chat template of {where} does not compile: {str(e).splitlines()[0][:200]}") \
                from None
        self.tracks = bool(_GENERATION.search(source))

    @classmethod
    def of(cls, tokenizer) -> "ChatTemplate":
        d = getattr(tokenizer, "path", None)
        if d is None:
            raise MemengineError("a {\"messages\": ...} record needs a chat template, and the byte-level tokenizer has "
                                 "none: give --tokenizer a tokenizer.json whose tokenizer_config.json holds one")
        src, specials = find_template(Path(d).parent)
        if src is None:
            raise MemengineError(f"a {{\"messages\": ...}} record needs a chat template; {Path(d).parent} has no "
                                 f"chat_template in tokenizer_config.json nor a {TEMPLATE_FILE}")
        return cls(src, specials, str(Path(d).parent))

    @contextmanager
    def _tracking(self, blocks, spans):
        env = self.template.environment
        env.chat_tracker = (blocks, spans)
        try:
            yield
        finally:
            env.chat_tracker = None

    def _render(self, messages: list, add_generation_prompt: bool, spans: Optional[list] = None) -> str:
        kw = dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                  **self.specials)
        try:
            if spans is None:
                return self.template.render(**kw)
            blocks: list = []
            with self._tracking(blocks, spans):
                for b in self.template.generate(**kw):
                    blocks.append(b)
            return "".join(blocks)
        except Exception as e:
            msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise MemengineError(f"the chat template of {self.where} failed on this conversation: {msg}") from None

    def render(self, messages: list, spans: bool = True) -> tuple[str, list]:
        """(text, assistant spans [(start, end)] in characters; [] when not `spans`)."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        if not spans:
            return self._render(messages, False), []
        if self.tracks:
            found: list = []
            return self._render(messages, False, found), found
        text = self._render(messages, False)
        out = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self._render(messages[:i], True) if i else ""
            upto = self._render(messages[:i + 1], False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise MemengineError(
                    f"the chat template of {self.where} does not render a conversation's first messages as the "
                    "start of the whole, so the assistant's turns cannot be told apart: give --train-on-prompt "
                    "to train on the whole conversation (or a template with {% generation %} blocks)")
            if len(upto) > len(before):
                out.append((len(before), len(upto)))
        return text, out
