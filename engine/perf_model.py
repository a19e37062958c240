"""A replica's measured compute capacity: step time as a function of the step's work, learned online.

    step seconds ~= c0 + c1 * tokens computed + c2 * KV tokens read

c0 is the per-step overhead (weights read once, launch and Python time), c1 the cost of one token through the
weights (what bounds prefill), c2 the cost of reading one cached token's KV in attention (what grows with
context). Fitted by least squares over recent steps with exponential forgetting (half the weight after
HALF_LIFE_STEPS), a small ridge towards zero, and coefficients kept >= 0. The engine feeds it every real step
(LLMEngine.step), the autoscaling simulator every simulated one, and the autoscaling policy reads the
coefficients each replica reports to size the fleet for an ITL and TTFT SLO. Pure Python, no torch.
"""
from __future__ import annotations

HALF_LIFE_STEPS = 2000
# features are scaled so the normal equations are well conditioned: tokens per 1000, KV tokens per 100k
TOKEN_SCALE = 1e3
KV_SCALE = 1e5
RIDGE = 1e-6


class StepTimeModel:
    def __init__(self, half_life_steps: int = HALF_LIFE_STEPS) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.xx = [[0.0] * 3 for _ in range(3)]
        self.xy = [0.0] * 3
        self.num_observed = 0
        self._coefficients: tuple[float, float, float] | None = None

    def observe(self, num_tokens: int, kv_tokens: int, seconds: float) -> None:
        x = (1.0, num_tokens / TOKEN_SCALE, kv_tokens / KV_SCALE)
        d = self.decay
        for i in range(3):
            self.xy[i] = self.xy[i] * d + x[i] * seconds
            row = self.xx[i]
            for j in range(3):
                row[j] = row[j] * d + x[i] * x[j]
        self.num_observed += 1
        self._coefficients = None

    def coefficients(self) -> tuple[float, float, float]:
        """(c0 seconds, c1 seconds per token, c2 seconds per KV token read); zeros before any step."""
        if self._coefficients is None:
            self._coefficients = self._fit()
        return self._coefficients

    def predict(self, num_tokens: float, kv_tokens: float) -> float:
        c0, c1, c2 = self.coefficients()
        return c0 + c1 * num_tokens + c2 * kv_tokens

    def _fit(self) -> tuple[float, float, float]:
        if self.num_observed == 0:
            return (0.0, 0.0, 0.0)
        active = [0, 1, 2]
        while True:  # least squares over the active terms; a negative one is dropped and the rest refitted
            a = [[self.xx[i][j] + (RIDGE * self.xx[0][0] if i == j else 0.0) for j in active] for i in active]
            b = [self.xy[i] for i in active]
            sol = _solve(a, b)
            if sol is not None and all(v >= 0 for v in sol):
                break
            if sol is None or len(active) == 1:
                sol = [max(0.0, v) for v in sol] if sol is not None else [0.0] * len(active)
                break
            worst = min(range(len(active)), key=lambda k: sol[k]) if sol is not None else len(active) - 1
            active.pop(worst)
        full = [0.0, 0.0, 0.0]
        for k, i in enumerate(active):
            full[i] = sol[k]
        return (full[0], full[1] / TOKEN_SCALE, full[2] / KV_SCALE)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
