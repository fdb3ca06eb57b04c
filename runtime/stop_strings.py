"""Stop strings (OpenAI `stop`): where one appears in the generated text, and how much of a text's end must be
held back while streaming because it might still become one. Pure functions over str; the request state
keeps the offsets."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.sampling import RequestError

MAX_STOP_STRINGS = 4  # OpenAI's limit


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """`stop` as OpenAI takes it (a string or a list of up to 4 non-empty strings) -> a tuple; RequestError."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise RequestError("stop", f"expected a string or a list of strings, got {stop!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(s == "" for s in items):
        raise RequestError("stop", "a stop string must not be empty")
    return tuple(dict.fromkeys(items))


def find_stop(text: str, start: int, stops: Sequence[str]) -> int | None:
    """The first index >= start - (longest stop - 1) where a stop string begins in `text` (the text before
    `start` was searched already, up to a stop string's length), None when none does."""
    if not stops:
        return None
    lo = max(0, start - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, lo) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, start: int, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` (none before `start`) could be the beginning of a stop
    string: the longest suffix that is a proper prefix of one. Those are not streamed yet."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text) - start), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
