"""Run a one-run privacy audit through the real pipeline and report what it shows.

White-box (``kind="whitebox"``): the audit model of canaries.py; after every step the auditor
reads each canary's tap coordinate (white-box access to every iterate, the threat model
DP-SGD's accounting assumes) and turns its per-step updates into scores:
  - likelihood: sum_t log(1 - q + q exp((2 z_t - 1) / (2 sigma^2))), the Neyman-Pearson test of
    "included" for z_t = update in units of lr * C / B (signal 1 when sampled, noise sigma);
  - variance: the spread of z_t over steps (a canary that is sampled sometimes moves unevenly).
Besides the epsilon lower bound, the auditor, who knows its own coin flips, checks the noise
that excluded canaries saw on each stage: its size against the claimed sigma and its
correlation from one step to the next (noise must be fresh every step).

Black-box (``kind="blackbox"``): the default GPT job with random canary sequences, scored by
their loss after training; such audits are loose by nature, and reported as such.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..config import PipelineConfig, PrivacyConfig
from ..data import CharTokenizer, generated_corpus, windows
from ..models import GPTConfig, tiny_gpt, token_loss
from ..privacy.streams import Stream, stream_seed
from ..train.trainer import PipelineDPTrainer
from .bounds import Guesses, NoiseCheck, best_guesses, guess_sizes, noise_checks
from .canaries import audit_data, audit_loss, audit_model, canary_block, tap_names


def _audited_pipeline() -> PipelineConfig:
    return PipelineConfig(stages=2, microbatches=4, transport="inprocess")


def _audited_privacy() -> PrivacyConfig:
    return PrivacyConfig(sample_rate=0.5, noise_multiplier=3.0, max_grad_norm=1.0, delta=1e-5)


@dataclass(frozen=True)
class AuditConfig:
    """The audit's own choices, and the pipeline and mechanism it audits (the trainer's two configs:
    the expected batch size is set from the data, and training seeds its streams with seed + 1)."""

    kind: str = "whitebox"  # or "blackbox"
    canaries: int = 1000
    examples: int = 200  # real training rows besides the canaries (white-box)
    steps: int = 10
    lr: float = 0.1
    confidence: float = 0.95
    seed: int = 0  # the audit's coin flips
    pipeline: PipelineConfig = field(default_factory=_audited_pipeline)
    privacy: PrivacyConfig = field(default_factory=_audited_privacy)


@dataclass
class AuditResult:
    config: Dict[str, Any]
    claimed_epsilon: float
    epsilon_lower_bound: float
    guesses: Optional[Guesses]
    noise_checks: List[NoiseCheck]
    included: List[bool]
    scores: Dict[str, List[float]]
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.epsilon_lower_bound <= self.claimed_epsilon and all(c.ok for c in self.noise_checks)

    @property
    def tightness(self) -> float:
        return self.epsilon_lower_bound / self.claimed_epsilon if self.claimed_epsilon > 0 else math.nan

    def to_dict(self) -> Dict[str, Any]:
        """Plain values (what crosses processes and goes to JSON)."""
        return asdict(self)

    @staticmethod
    def from_dict(d: Dict[str, Any]) -> "AuditResult":
        d = dict(d)
        d["guesses"] = Guesses(**d["guesses"]) if d["guesses"] is not None else None
        d["noise_checks"] = [NoiseCheck(**c) for c in d["noise_checks"]]
        return AuditResult(**d)

    def summary(self) -> str:
        c, g = self.config, self.guesses
        lines = [
            f"{c['kind']} audit: {c['canaries']} canaries, {c['steps']} steps, sample rate "
            f"{c['privacy']['sample_rate']}, noise multiplier {c['privacy']['noise_multiplier']}, "
            f"{c['pipeline']['stages']} stages",
            f"accountant epsilon            {self.claimed_epsilon:.3f} at delta {c['privacy']['delta']:g}",
            f"empirical epsilon lower bound {self.epsilon_lower_bound:.3f} at {c['confidence']:.0%} confidence "
            f"(lower bound / claimed = {self.tightness:.2f})",
        ]
        if g is not None:
            lines.append(
                f"guesses: {g.k_plus} 'in' + {g.k_minus} 'out' by the {g.score} score, {g.correct} correct "
                f"of {g.k_plus + g.k_minus}"
            )
        for n in self.noise_checks:
            lines.append(
                f"stage {n.stage} noise: sigma {n.measured_sigma:.3f} measured vs {n.claimed_sigma:.3f} claimed, "
                f"step-to-step correlation {n.step_correlation:+.3f} over {n.samples} values: "
                + ("ok" if n.ok else f"FAILED ({n.problem})")
            )
        lines += self.notes
        lines.append(
            "verdict: "
            + (
                "PASSED: nothing shows more privacy loss than the accountant claims"
                if self.passed
                else "FAILED: the implementation leaks more than the accountant claims"
            )
        )
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(self.scores), figsize=(5 * len(self.scores), 3.4), squeeze=False)
        inc = np.array(self.included)
        for ax, (name, values) in zip(axes[0], self.scores.items()):
            v = np.array(values)
            bins = np.linspace(v.min(), v.max(), 40) if v.max() > v.min() else 10
            ax.hist(v[inc], bins=bins, alpha=0.6, label="included")
            ax.hist(v[~inc], bins=bins, alpha=0.6, label="excluded")
            ax.set_title(f"{name} score")
            ax.legend()
        fig.suptitle(f"eps lower bound {self.epsilon_lower_bound:.2f} vs accountant {self.claimed_epsilon:.2f}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def coin_flips(canaries: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(stream_seed(Stream.AUDIT, seed, 0))
    return torch.rand(canaries, generator=g, dtype=torch.float64) < 0.5


def audit_rank(rank: int, config: AuditConfig) -> Optional[Dict[str, Any]]:
    """One rank of a multi-process audit (for pipedp.launch or torchrun): rank 0 returns the result."""
    result = run_audit(config, rank)
    return result.to_dict() if result is not None else None


def run_audit(config: AuditConfig, rank: int = 0) -> Optional[AuditResult]:
    """The audit on this rank (in-process: every stage here). Rank 0 returns the result."""
    start = time.perf_counter()
    if config.kind == "whitebox":
        result = _whitebox(config, rank)
    elif config.kind == "blackbox":
        result = _blackbox(config, rank)
    else:
        raise ValueError(f"unknown audit kind {config.kind!r}: 'whitebox' or 'blackbox'")
    if result is not None:
        result.seconds = time.perf_counter() - start
    return result


def _trainer(model, loss, config: AuditConfig, expected_batch: int) -> PipelineDPTrainer:
    privacy = replace(config.privacy, expected_batch_size=expected_batch, seed=config.seed + 1)
    return PipelineDPTrainer(
        model, loss, lambda p: torch.optim.SGD(p, lr=config.lr), pipeline=config.pipeline, privacy=privacy
    )


def _whitebox(config: AuditConfig, rank: int) -> Optional[AuditResult]:
    m, features, width = config.canaries, 8, 16
    privacy = config.privacy
    rate, delta, sigma = privacy.sample_rate or 1.0, privacy.delta, privacy.noise_multiplier
    assert isinstance(privacy.max_grad_norm, (int, float)), "the audit clips flat, with one max_grad_norm"
    clip = float(privacy.max_grad_norm)
    included = coin_flips(m, config.seed)
    model = audit_model(features, width, blocks=max(2, config.pipeline.stages), canaries=m, seed=config.seed)
    taps, hosts = tap_names(model), canary_block(model)
    x, y = audit_data(features, m, config.examples, included, config.seed)
    expected = max(1, round(rate * len(x)))
    trainer = _trainer(model, audit_loss, config, expected)
    stage_of_block = [s for s, n in enumerate(trainer.partition_report.blocks_per_stage) for _ in range(n)]
    history: List[np.ndarray] = []

    def record(step, loss, tr):
        state = tr.state_dict()
        if state is not None:
            history.append(torch.cat([state[k].reshape(-1) for k in taps]).numpy().copy())

    record(0, 0.0, trainer)
    trainer.fit((x, y), steps=config.steps, callback=record)
    claimed = trainer.epsilon(delta)
    trainer.close()
    if rank != 0:
        return None
    z = np.diff(np.stack(history), axis=0) * expected / (config.lr * clip)  # [T, m]
    stages = np.array([stage_of_block[b] for b in hosts])
    scores = whitebox_scores(z, rate, stages)
    beta = 1 - config.confidence
    guesses = best_guesses(
        {k: v.tolist() for k, v in scores.items()}, included.tolist(), guess_sizes(m), beta / 2, delta
    )  # half of beta for the bound, half for the noise checks
    checks = noise_checks(z, included.numpy(), stages, config.pipeline.stages, sigma, beta / 2)
    return AuditResult(
        asdict(config),
        claimed,
        guesses.epsilon,
        guesses,
        checks,
        included.tolist(),
        {k: v.tolist() for k, v in scores.items()},
    )


def whitebox_scores(z: np.ndarray, q: float, stage_of: np.ndarray) -> Dict[str, np.ndarray]:
    """Scores from the per-step updates z [T, m] (in units of lr * C / B; 1 when sampled, plus noise).

    The likelihood score uses each stage's noise level as the updates show it (E[z^2] = sigma^2 +
    q / 2, half the canaries being in), not the claimed one: a stage that adds too little noise
    then separates its canaries as sharply as it really does."""
    likelihood = np.zeros(z.shape[1])
    for s in np.unique(stage_of):
        cols = stage_of == s
        sigma2 = max(float((z[:, cols] ** 2).mean()) - q / 2, 1e-4)
        a = (2 * z[:, cols] - 1) / (2 * sigma2)
        likelihood[cols] = (np.logaddexp(np.log1p(-q), math.log(q) + a) if q < 1 else a).sum(axis=0)
    return {"likelihood": likelihood, "variance": z.var(axis=0)}


def _blackbox(config: AuditConfig, rank: int) -> Optional[AuditResult]:
    seq = 16
    text = generated_corpus(seed=config.seed)
    tok = CharTokenizer.fit(text)
    x, y = windows(tok.encode(text), seq)
    m = config.canaries
    included = coin_flips(m, config.seed)
    g = torch.Generator().manual_seed(stream_seed(Stream.AUDIT, config.seed, 1))
    canary_x = torch.randint(0, tok.vocab_size, (m, seq), generator=g)
    canary_y = torch.randint(0, tok.vocab_size, (m, seq), generator=g)
    train_x = torch.cat([x, canary_x[included]])
    train_y = torch.cat([y, canary_y[included]])
    cfg = GPTConfig(vocab_size=tok.vocab_size, seq_len=seq, d_model=64, n_heads=4, n_layers=4)
    torch.manual_seed(config.seed)
    rate, delta = config.privacy.sample_rate or 1.0, config.privacy.delta
    trainer = _trainer(tiny_gpt(cfg), token_loss, config, max(1, round(rate * len(train_x))))
    trainer.fit((train_x, train_y), steps=config.steps)
    claimed = trainer.epsilon(delta)
    state = trainer.state_dict()
    trainer.close()
    if rank != 0:
        return None
    fresh = tiny_gpt(cfg)
    fresh.load_state_dict(state)
    with torch.no_grad():
        scores = -token_loss(fresh(canary_x), canary_y).double().numpy()  # low loss: probably trained on
    beta = 1 - config.confidence
    guesses = best_guesses({"loss": scores.tolist()}, included.tolist(), guess_sizes(m), beta, delta)
    return AuditResult(
        asdict(config),
        claimed,
        guesses.epsilon,
        guesses,
        [],
        included.tolist(),
        {"loss": scores.tolist()},
        notes=[
            "black-box: canaries scored by their loss after training; such audits are loose "
            "(a bound near 0 says little), the white-box audit is the strong one"
        ],
    )
