"""What the node has measured, as small online estimators (adaptive disaggregation's inputs).

Pure arithmetic, no clocks: callers pass the numbers they observed. Each estimator forgets
slowly (a weight per sample that decays), so a node that warms up, or slows down under
other work, is followed within tens of requests. `prompt_size` reads a request's prompt
size from its body (token ids given, characters of text) for `TokensPerChar`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from appliance.proxy.openai_api import CHAT, RESPONSES

# A sample's weight falls by this factor per later sample: about the last 20-40 count.
FORGET = 0.95
# A line that ages with time is forgotten below this much of one sample's weight.
FORGOTTEN = 0.25


@dataclass
class Linear:
    """t ≈ a + b·x fitted by least squares with forgetting: x is prefill work (tokens ahead
    in the node's queue plus the request's own), t the seconds it took. With too little
    spread in x the fit falls back to proportional (a = 0), which still ranks work right."""

    forget: float = FORGET
    # Optional: the samples' weight also halves every `half_life_s` (`age`), and the line
    # is forgotten once less than FORGOTTEN of a sample's weight is left; a sample above
    # `clip` times the line's prediction counts as that (one outlier moves it little).
    half_life_s: float | None = None
    clip: float | None = None
    samples: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0
    _at: float | None = None  # when `age` last ran

    def age(self, now: float) -> None:
        """Forgets what time has passed since the last call (with a `half_life_s`)."""
        if self.half_life_s is None:
            return
        if self._at is not None and now > self._at and self.samples:
            f = 0.5 ** ((now - self._at) / self.half_life_s)
            self._w, self._x, self._y = self._w * f, self._x * f, self._y * f
            self._xx, self._xy = self._xx * f, self._xy * f
            if self._w < FORGOTTEN:
                self._w = self._x = self._y = self._xx = self._xy = 0.0
                self.samples = 0
        self._at = now

    def observe(self, x: float, t: float, now: float | None = None) -> None:
        if x < 0 or t < 0:
            return
        if now is not None:
            self.age(now)
        if self.clip is not None and self.samples >= 3:
            line = self.predict(x)
            if line:
                t = min(t, self.clip * line)
        f = self.forget
        self._w = self._w * f + 1.0
        self._x = self._x * f + x
        self._y = self._y * f + t
        self._xx = self._xx * f + x * x
        self._xy = self._xy * f + x * t
        self.samples += 1

    def _line(self) -> tuple[float, float] | None:
        """(a, b) where x's spread determines the slope, else None."""
        w, sx, sy = self._w, self._x, self._y
        det = w * self._xx - sx * sx
        # Spread of x relative to its size: below ~5% the slope is noise.
        if det > 0.0025 * sx * sx and self.samples >= 3:
            b = (w * self._xy - sx * sy) / det
            a = (sy - b * sx) / w
            if b >= 0 and a >= 0:
                return a, b
            if b >= 0:  # a negative intercept: the line through the origin is closer
                return 0.0, self._xy / self._xx if self._xx else 0.0
        return None

    def slope(self) -> float | None:
        """b, only where the samples' spread measured it (the proportional fallback would
        charge every unit of x the whole of t)."""
        line = self._line() if self.samples else None
        return None if line is None else line[1]

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before the first sample."""
        if not self.samples:
            return None
        line = self._line()
        if line is not None:
            return line
        w, sx, sy = self._w, self._x, self._y
        mean_x, mean_y = sx / w, sy / w
        if mean_x <= 0:
            return mean_y, 0.0
        return 0.0, mean_y / mean_x

    def predict(self, x: float) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * x

    def describe(self) -> dict[str, Any]:
        c = self.coefficients()
        if c is None:
            return {"samples": 0}
        a, b = c
        return {"samples": self.samples, "fixed_ms": round(a * 1000, 3),
                "per_1k_tokens_ms": round(b * 1e6, 3)}


@dataclass
class TokensPerChar:
    """Prompt tokens per character of prompt text, learned from the engines' usage counts
    (one per route: a chat's template adds tokens that a completion's prompt has not)."""

    prior: float = 0.3  # until the first answer: about 3.3 characters per token
    forget: float = FORGET
    _tokens: float = 0.0
    _chars: float = 0.0

    def observe(self, chars: int, tokens: int) -> None:
        if chars <= 0 or tokens <= 0:
            return
        self._tokens = self._tokens * self.forget + tokens
        self._chars = self._chars * self.forget + chars

    @property
    def ratio(self) -> float:
        return self._tokens / self._chars if self._chars else self.prior


@dataclass
class Mean:
    """A mean that forgets slowly (the output tokens of recent requests)."""

    forget: float = FORGET
    _sum: float = 0.0
    _w: float = 0.0

    def observe(self, value: float) -> None:
        self._sum = self._sum * self.forget + value
        self._w = self._w * self.forget + 1.0

    @property
    def value(self) -> float | None:
        return self._sum / self._w if self._w else None


@dataclass
class StepTimes:
    """D's time per streamed token, from the streams the proxy relays. The budget a local
    prefill may add to a decode step is a multiple of a low quantile of these: the step
    time D has when nothing stalls it (prefills on D, which this guards against, raise
    the mean and would loosen the budget they are checked against)."""

    window: int = 64
    quantile: float = 0.25
    _recent: deque[float] = field(default_factory=deque)

    def observe(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self._recent.append(seconds)
        if len(self._recent) > self.window:
            self._recent.popleft()

    def base(self) -> float | None:
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]


def prompt_size(body: dict[str, Any], route: str) -> tuple[int, int]:
    """(token ids given, characters of text) of a request's prompt."""
    ids = chars = 0
    if route == CHAT:
        return 0, sum(_message_chars(m) for m in body.get("messages") or ())
    if route == RESPONSES:
        given = body.get("input")
        items = [{"content": given}] if isinstance(given, str) else given or ()
        instructions = body.get("instructions")
        chars = len(instructions) if isinstance(instructions, str) else 0
        return 0, chars + sum(_message_chars(m) for m in items)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return 0, len(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return len(prompt), 0
        for p in prompt:  # several prompts: each is prefilled
            if isinstance(p, str):
                chars += len(p)
            elif isinstance(p, list):
                ids += len(p)
    return ids, chars


def _message_chars(message: Any) -> int:
    """The characters of a chat message's text, or of a Responses input item's."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, dict) and isinstance(part.get("text"), str))
    return 0
