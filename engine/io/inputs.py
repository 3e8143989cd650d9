"""Input files read as untrusted: regular files only, bounded sizes, bounded parsing.

* `check_regular` / `open_regular`: a FIFO, a device (``/dev/zero``), a socket or a
  directory given where a file is expected is refused from its `stat`, before it is opened
  (opening a FIFO blocks until a writer comes; reading ``/dev/zero`` never ends).
* `loads_json`: JSON nested at most `MAX_DEPTH` levels (checked on the text before the
  recursive parser runs), numbers of at most `MAX_NUMBER_CHARS` characters (Python refuses
  integers of more than 4300 digits with a ValueError), duplicate keys refused.
* `load_yaml`: the safe loader without aliases (`&a` / `*a`: an alias bomb expands a few
  lines into billions of nodes), with the same depth and number limits.
* `read_json` / `read_config_data`: a small file (`MAX_CONFIG_BYTES`) read and parsed so.

Every problem is one `MemengineError` naming the file (or the `source` given) and what
would fix it. Light on purpose (no numpy): the command line imports it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate, repeat
from operator import sub
from pathlib import Path
from typing import Any, BinaryIO

from memengine.engine.errors import MemengineError

MAX_DEPTH = 64  # nesting of arrays/objects; real configs use fewer than 10
MAX_NUMBER_CHARS = 100  # a u64 has 20 digits, a float's repr fewer than 25 characters
MAX_CONFIG_BYTES = 16 * 2**20  # config.json, index json, JSON --config and init CONFIG files
MAX_YAML_BYTES = 2**20  # YAML --config and init CONFIG files (the pure-Python parser is slow)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _at(source: str | None, why: str) -> str:
    return f"{source}: {why}" if source else why


def file_kind(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for a stat mode that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def stat_input(path: str | Path, what: str = "file") -> os.stat_result:
    """os.stat(path) (symlinks followed); a missing or unreadable path is one MemengineError
    naming `what` ("model file", "data file", ...)."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise MemengineError(f"{what} '{path}' not found") from None
    except OSError as e:
        raise MemengineError(f"{what} '{path}': cannot read ({e.strerror or e})") from None


def check_regular(path: str | Path, what: str = "file") -> os.stat_result:
    """The stat of `path`, which must be a regular file (a symlink to one is fine).

    `what` says what the file is for ("model file", "config file", ...) in the message."""
    p = Path(path)
    st = stat_input(p, what)
    if not stat.S_ISREG(st.st_mode):
        raise MemengineError(f"{what} '{p}' is {file_kind(st.st_mode)}, not a regular file; give the path of a "
                             "regular file")
    return st


def open_regular(path: str | Path, what: str = "file") -> BinaryIO:
    """Open `path` for binary reading, refusing anything but a regular file without blocking
    (checked before opening, and again on the open descriptor)."""
    p = Path(path)
    check_regular(p, what)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise MemengineError(f"{what} '{p}': cannot read ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the two looks
        os.close(fd)
        raise MemengineError(f"{what} '{p}' is {file_kind(st.st_mode)}, not a regular file")
    return os.fdopen(fd, "rb")


def read_small(path: str | Path, what: str = "file", max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of a regular file of at most `max_bytes` bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise MemengineError(f"{what} '{path}' is {size:,} bytes; a file of this kind is at most "
                                 f"{max_bytes:,} (is it the right file?)")
        try:
            return f.read(max_bytes + 1)[:max_bytes]
        except OSError as e:
            raise MemengineError(f"{what} '{path}': cannot read ({e.strerror or e})") from None


def decode_utf8(raw: bytes, source: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MemengineError(f"{source}: not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    return text[1:] if text.startswith("\ufeff") else text


# ------------------------------------------------------------------------------ JSON
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
_BRACKET_STEPS = str.maketrans({"[": "\x02", "{": "\x02", "]": "\x00", "}": "\x00"})


def json_depth(text: str) -> int:
    """The deepest nesting of arrays/objects in JSON text (brackets inside strings ignored);
    linear in the text, no recursion."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    steps = brackets.translate(_BRACKET_STEPS).encode("latin-1")  # 2 opens, 0 closes
    chunk = 1 << 22
    if len(steps) <= chunk:
        return max(accumulate(map(sub, steps, repeat(1))), default=0)
    import numpy as np  # millions of brackets: only a hostile file has them

    best = depth = 0
    for i in range(0, len(steps), chunk):
        run = np.cumsum(np.frombuffer(steps, np.int8, min(chunk, len(steps) - i), i).astype(np.int64) - 1) + depth
        best, depth = max(best, int(run.max())), int(run[-1])
    return best


class _Refused(ValueError):
    pass


def _number(kind, negative: bool = True):
    def parse(s: str):
        if not negative and s.startswith("-"):
            raise _Refused(f"a negative number ({s[:24]}) where only sizes and offsets belong")
        if len(s) > MAX_NUMBER_CHARS:
            raise _Refused(f"a number of {len(s):,} characters ({s[:12]}...; at most {MAX_NUMBER_CHARS} "
                           "are accepted)")
        return kind(s)
    return parse


def _no_constants(name: str):
    raise _Refused(f"{name} is not a JSON value")


def _pairs_no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise _Refused(f"duplicate key {k!r} (each key may appear once)")
        d[k] = v
    return d


def loads_json(text: str | bytes, source: str | None = None, *, duplicates: bool = False,
               constants: bool = True, negative: bool = True) -> Any:
    """Parse JSON with the limits of this module. `duplicates` lets a later key replace an
    earlier one (as json.loads does); `constants` allows NaN/Infinity (Python's extension);
    `negative=False` refuses negative numbers (a safetensors header has none)."""
    if isinstance(text, (bytes, bytearray)):
        text = decode_utf8(bytes(text), source or "JSON")
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise MemengineError(_at(source, f"JSON nested {depth:,} levels deep (at most {MAX_DEPTH} are accepted; "
                                         "is it the right file?)"))
    try:
        return json.loads(text, parse_int=_number(int, negative), parse_float=_number(float, negative),
                          parse_constant=None if constants else _no_constants,
                          object_pairs_hook=None if duplicates else _pairs_no_duplicates)
    except _Refused as e:
        raise MemengineError(_at(source, str(e))) from None
    except json.JSONDecodeError as e:
        raise MemengineError(_at(source, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})")) from None
    except (ValueError, RecursionError) as e:  # pragma: no cover - the limits above come first
        raise MemengineError(_at(source, f"not valid JSON ({str(e)[:120]})")) from None


def read_json(path: str | Path, what: str = "JSON file", max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """A small JSON file (regular, at most `max_bytes`), parsed with this module's limits."""
    src = str(path)
    return loads_json(decode_utf8(read_small(path, what, max_bytes), src), src)


# ------------------------------------------------------------------------------ YAML
def _yaml_loader():
    import yaml

    class Refused(yaml.MarkedYAMLError):
        pass

    class BoundedSafeLoader(yaml.SafeLoader):
        """yaml.SafeLoader refusing aliases, deep nesting, long numbers and duplicate keys."""

        _depth = 0

        def compose_node(self, parent, index):
            ev = self.peek_event()
            if isinstance(ev, yaml.AliasEvent):
                raise Refused(None, None, f"an alias (*{ev.anchor}) is not accepted: write the value out "
                                          "(aliases can expand a few lines into billions of values)", ev.start_mark)
            # collections count, as in JSON's limit (a scalar inside 64 lists is 64 deep)
            level = int(isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)))
            self._depth += level
            try:
                if self._depth > MAX_DEPTH:
                    raise Refused(None, None, f"nested more than {MAX_DEPTH} levels deep", ev.start_mark)
                return super().compose_node(parent, index)
            finally:
                self._depth -= level

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    if key_node.value in seen:
                        raise Refused(None, None, f"duplicate key {key_node.value!r} (each key may appear once)",
                                      key_node.start_mark)
                    seen.add(key_node.value)
            return super().construct_mapping(node, deep)

    def bounded(tag):
        base = BoundedSafeLoader.yaml_constructors[tag]

        def construct(loader, node):
            if len(str(node.value)) > MAX_NUMBER_CHARS:
                raise Refused(None, None, f"a number of {len(node.value):,} characters ({node.value[:12]}...; "
                                          f"at most {MAX_NUMBER_CHARS} are accepted)", node.start_mark)
            return base(loader, node)
        return construct

    for tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float"):
        BoundedSafeLoader.add_constructor(tag, bounded(tag))
    return BoundedSafeLoader, Refused


_LOADER = None


def load_yaml(text: str, source: str | None = None) -> Any:
    """Parse YAML with the safe loader, refusing aliases, nesting beyond `MAX_DEPTH`,
    numbers longer than `MAX_NUMBER_CHARS` and duplicate keys."""
    global _LOADER
    import yaml

    if _LOADER is None:
        _LOADER = _yaml_loader()
    loader, refused = _LOADER
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        why = getattr(e, "problem", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        why = why if isinstance(e, refused) else f"not valid YAML ({why})"
        raise MemengineError(_at(source, f"{why}{where}")) from None
    except RecursionError:  # pragma: no cover - the depth limit comes first
        raise MemengineError(_at(source, "not valid YAML (nested too deeply)")) from None


def read_config_data(path: str | Path, what: str = "config file", source: str | None = None, *,
                     yaml: bool | None = None) -> Any:
    """A YAML (at most `MAX_YAML_BYTES`) or JSON (at most `MAX_CONFIG_BYTES`) file, parsed
    with this module's limits: YAML when `yaml` says so, or by default when the name ends in
    .yaml/.yml. Messages start with `source` (default: the path)."""
    p = Path(path)
    src = source or str(p)
    if yaml is None:
        yaml = p.suffix.lower() in (".yaml", ".yml")
    text = decode_utf8(read_small(p, what, MAX_YAML_BYTES if yaml else MAX_CONFIG_BYTES), src)
    return load_yaml(text, src) if yaml else loads_json(text, src)
