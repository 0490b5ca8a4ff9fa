"""A Hugging Face decoder's mixture-of-experts blocks: accepted when pipedp's rules can train them
exactly (privacy/rules/experts.py), refused at construction, by name, otherwise.

A block is accepted when it is dropless top-k routing over a fused expert bank (transformers'
``use_experts_implementation`` layout; or DBRX's, row slices of [E h, d] matrices: rules/sliced_experts.py)
by a router whose first output is a Linear's logits over the tokens (or the logits alone, which its block
routes: DBRX), both checked on a few random tokens against the block's own modules; shared experts and
their gates are ordinary layers. A block whose experts or router have no closed-form rule (JetMoE's experts,
called on tokens sorted by expert; ZAYA's MLP router) is one layer replayed one sample at a time
(rules/generic.py ``LOOPED``). What couples samples is refused: a batch-level load-balancing loss
(``output_router_logits``), noise written into the hidden states in place (``*_jitter_noise``), expert
parallelism, a trainable parameter of the router other than its weight and bias (bias balancing). A router
that samples its experts in training (Phi-MoE's sparsemixer) draws per token, which couples no samples: the
rules read the experts and weights the forward drew, the router's gradient is autograd's through the model's
own backward, and its logits are checked in training mode too.
A block frozen whole needs no rule and is accepted as it is (the self-check still compares each checked
sample's output from its own rows alone, so a block that mixes samples is refused there).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UnsupportedModelError
from ..privacy.rules import EXPERTS, ROUTER, register
from ..privacy.rules.dense_experts import (
    DENSE_EXPERTS,
    SCORING_ROUTER,
    experts_of,
    is_dense_bank,
    recomputed_bank_output,
)
from ..privacy.rules.expert_lora import (
    ADAPTED_DENSE_EXPERTS,
    ADAPTED_EXPERTS,
    DENSE_WEIGHTS,
    adapted,
    factors,
    low_rank,
    wrapped_bank,
    wrappers,
)
from ..privacy.rules.experts import first_weights, recomputed_output, second_weights, weight_names
from ..privacy.rules.generic import LOOPED
from ..privacy.rules.registry import typed_rule, unregister
from ..privacy.rules.sliced_experts import SLICED_EXPERTS, is_sliced_bank, recomputed_sliced_output, sliced_weights
from ..rounding import agree
from .hf_runs import Stop, modes_kept, rng_kept

# a mixture-of-experts block's class (Mixtral's SparseMoeBlock, JetMoe's MoE, a Router), not e.g. Qwen2MoeAttention
ROUTING = re.compile(r"expert|router|sparse_?moe|moe(block|layer|mlp)?$", re.IGNORECASE)
CHECK_TOKENS = 5  # the random tokens a bank and its router are checked on
ROUTER_NAMES = ("gate", "router")
# (a module's attribute, the config's name) of noise multiplied into the hidden states in training
JITTER = (
    ("jitter_noise", "router_jitter_noise"),
    ("input_jitter_noise", "input_jitter_noise"),
    ("moe_jitter_eps", "ffn_config.moe_jitter_eps"),
)
PEFT_READ = (0, 20)  # the PEFT whose expert adapters (target_parameters) pipedp's rules read: 0.18, 0.19 store others
# the way out of every refusal below: a block frozen whole needs no rule (accept_experts skips it)
FREEZE = "freeze the whole block (block.requires_grad_(False): a frozen block needs no rule)"


def moe_parts(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The mixture-of-experts parts below ``module``: modules with an ``experts`` attribute, and the outermost
    modules besides them whose class name says they route (JetMoE's MoE beside its attention's ``experts``)."""
    modules = list(module.named_modules())[1:]  # the module's own class name may say MoE
    found = [(n, m) for n, m in modules if hasattr(m, "experts")]
    for n, m in modules:  # by name, and routing for real: a part that routes, or expert weights [E, ...] (not GLM's
        # MoeMLP); not inside or around a part found before
        if ROUTING.search(type(m).__name__) and _routes(m) and not any(_nested(n, f) for f, _ in found):
            found.append((n, m))
    return found


def _nested(a: str, b: str) -> bool:
    """One of the two module paths is the other or below it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _routes(module: nn.Module) -> bool:
    parts = list(module.modules())[1:]
    return any(ROUTING.search(type(c).__name__) for c in parts) or any(p.dim() >= 3 for p in module.parameters())


def accept_experts(model: nn.Module, path: str, module: nn.Module) -> None:
    """Register the rules for each MoE block below ``module`` (at ``path`` in ``model``), or refuse it."""
    for name, block in moe_parts(module):
        where = f"{type(model).__name__}: {f'{path}.{name}' if path else name} ({type(block).__name__})"
        _refuse_config(where, getattr(model, "config", None), block)
        if not any(p.requires_grad for p in block.parameters()):
            continue  # frozen whole: no rule reads it, the self-check still sees whether it keeps samples apart
        outer = getattr(block, "experts", None)
        bank = wrapped_bank(outer) if isinstance(outer, nn.Module) else outer
        if type(bank).__module__.startswith("peft."):
            raise UnsupportedModelError(
                f"{where}: PEFT's {type(bank).__module__}.{type(bank).__name__} on the experts has no per-sample rule "
                "(pipedp trains LoRA on their parameters, LoraConfig's target_parameters): use LoRA, or put the "
                "adapters on the attention and other Linear layers (target_modules)"
            )
        if isinstance(bank, nn.Module) and is_dense_bank(bank):  # Llama-4: every token through every expert
            router, _ = _router(where, block, bank)
            if outer is not bank:
                _refuse_adapter_states(where, outer, bank)
            _check_dense(where, router, bank, outer)
            register(type(router), SCORING_ROUTER)
            register(type(bank), DENSE_EXPERTS)
            continue
        if isinstance(bank, nn.Module) and is_sliced_bank(bank):  # DBRX: experts as row slices of [E h, d]
            _refuse_adapters_below(where, outer)
            router, logits = _router(where, block, bank)
            _check(where, logits, _as_called(where, block, router, logits), bank, outer)
            register(type(bank), SLICED_EXPERTS)
            continue
        if not isinstance(bank, nn.Module) or not _is_fused_bank(bank) or _linear_router(block, bank) is None:
            _replay_whole(where, block, outer)
            continue
        router, logits = _router(where, block, bank)
        if outer is not bank:
            _refuse_adapter_states(where, outer, bank)
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        _check(where, logits, _as_called(where, block, router, logits, vocab), bank, outer)
        if logits is router:  # (a Linear child computing the logits is a Linear on flattened tokens: hf_capturable)
            register(type(router), ROUTER)
        register(type(bank), EXPERTS)


def _replay_whole(where: str, block: nn.Module, outer: Any) -> None:
    """A block pipedp has no closed-form rule for (JetMoE's experts called on tokens sorted by expert; ZAYA's
    router, an MLP) is one layer, replayed one sample at a time; the capture checks at its first call that a sample
    alone gives its rows of the batch and that it draws no random numbers (rules.LayerRule.alone), the self-check
    its gradients. PEFT's adapters inside are replayed with it, but for its wrapper in place of the ``mlp`` of
    DBRX's sliced experts, which breaks the block's own forward (it reads ``mlp.v1``): refused by name."""
    if type(getattr(outer, "mlp", None)).__module__.startswith("peft."):
        _refuse_adapters_below(where, outer)
    if typed_rule(block) is not LOOPED:
        warnings.warn(
            f"{where} has experts or a router pipedp has no closed-form rule for: it is replayed one sample at a "
            "time (exact, slower than a fused expert bank)",
            stacklevel=2,
        )
    register(type(block), LOOPED)


def forget_replayed(layers: nn.Module) -> None:
    """The mixture-of-experts classes below ``layers`` no longer replayed per sample (LOOPED) for an earlier model:
    accept_experts decides again (registrations are per class)."""
    for layer in layers.children():
        for _, block in moe_parts(layer):
            unregister(type(block), LOOPED)


def _refuse_adapters_below(where: str, outer: Any) -> None:
    """PEFT's adapters inside experts that are not a fused bank (DBRX's row slices): no rule reads them."""
    modules = outer.named_modules() if isinstance(outer, nn.Module) else []
    below = [n for n, m in modules if type(m).__module__.startswith("peft.")]
    if below:
        raise UnsupportedModelError(
            f"{where}: PEFT's adapters on its experts ({below[0]}), which are not a fused bank [experts, out, in], "
            f"have no per-sample rule: put the adapters on the attention and other Linear layers, or {FREEZE}"
        )


def refuse_experts(model: nn.Module, why: str) -> None:
    """Refuse a mixture of experts anywhere in ``model`` where ``why`` the adapter cannot drive it."""
    found = moe_parts(model)
    if found:
        name, part = found[0]
        raise UnsupportedModelError(
            f"{type(model).__name__}: {name} ({type(part).__name__}) is a mixture of experts, which pipedp trains "
            f"only inside a Hugging Face decoder it drives ({why})"
        )


def _refuse_config(where: str, config, block: nn.Module) -> None:
    if getattr(config, "output_router_logits", False):
        raise UnsupportedModelError(
            f"{where}: output_router_logits=True adds the load-balancing loss, whose expert fractions and mean "
            "router probabilities are statistics of the whole batch (one sample's loss depends on the others): "
            "set config.output_router_logits = False"
        )
    for key, name in JITTER:
        for module in block.modules():  # (DBRX's router holds its own)
            if float(getattr(module, key, 0.0) or 0.0) > 0:
                raise UnsupportedModelError(
                    f"{where}: {name}={getattr(module, key)} multiplies the hidden states by noise in place in "
                    f"training (a change pipedp's capture refuses): set config.{name} = 0.0 (None for DBRX's)"
                )


def _is_fused_bank(bank: nn.Module) -> bool:
    first = "gate_up_proj" if getattr(bank, "has_gate", None) else "up_proj"
    return (
        hasattr(bank, "has_gate")
        and hasattr(bank, "is_transposed")
        and isinstance(getattr(bank, first, None), nn.Parameter)
        and isinstance(getattr(bank, "down_proj", None), nn.Parameter)
        and getattr(bank, first).dim() == 3
    )


def _experts(bank: nn.Module) -> int:
    """How many experts a routed bank holds."""
    return bank.num_experts if is_sliced_bank(bank) else bank.down_proj.shape[0]


def _random_routing(g: torch.Generator, x: torch.Tensor, experts: int, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], experts [T, k]): k distinct experts per token and positive weights, drawn at random."""
    index = torch.rand(x.shape[0], experts, generator=g).argsort(-1)[:, :k].to(x.device)
    return torch.rand(x.shape[0], k, generator=g, dtype=torch.float64).add(0.5).to(x.device, x.dtype), index


def _logits_layer(router: nn.Module) -> nn.Module:
    """What computes the router's logits: the router with a weight of its own, else its one Linear child
    (AFMoE's router.gate)."""
    if isinstance(getattr(router, "weight", None), nn.Parameter):
        return router
    linears = [m for m in router.children() if isinstance(m, nn.Linear)]
    return linears[0] if len(linears) == 1 and not any(p.requires_grad for p in router.parameters(False)) else router


def _linear_router(block: nn.Module, bank: nn.Module) -> Optional[Tuple[nn.Module, nn.Module]]:
    """The block's router and what computes its logits (_logits_layer), if they are a Linear's over the experts."""
    found = [m for n, m in block.named_children() if n in ROUTER_NAMES and m is not bank]
    if not found:
        return None
    logits = _logits_layer(found[0])
    weight = getattr(logits, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or weight.shape[0] != _experts(bank):
        return None
    return found[0], logits


def _router(where: str, block: nn.Module, bank: nn.Module) -> Tuple[nn.Module, nn.Module]:
    """The block's router, and what computes its logits (_logits_layer)."""
    experts = _experts(bank)
    pair = _linear_router(block, bank)
    if pair is None:
        raise UnsupportedModelError(
            f"{where}: no router (a child named {' or '.join(ROUTER_NAMES)} with a weight [{experts}, hidden], or one "
            f"Linear child with it) was found beside its experts: {FREEZE}, or use a dense model"
        )
    router, logits = pair
    weight = logits.weight
    if getattr(bank, "has_post_expert_norm", False) or getattr(bank, "_is_expert_parallel", False):
        raise UnsupportedModelError(
            f"{where}: expert parallelism and a norm after each expert are not supported: use a plain expert bank"
        )
    read = {id(weight), id(getattr(logits, "bias", None))}  # (what computes the logits)
    extra = [n for n, p in router.named_parameters() if p.requires_grad and id(p) not in read]
    if extra:
        raise UnsupportedModelError(
            f"{where}: the router's {extra} are trainable, but they set which experts a token goes to (bias "
            "balancing), not its output's gradient: freeze them (requires_grad_(False))"
        )
    return router, logits


@dataclass
class _RouterCall:
    """The router as its block calls it: the hidden states in the block's layout (``dim``: AFMoE's router
    takes them [batch, T, hidden]) and the other arguments the block passes (MiniMax-M2 and HY-V3 pass their
    ``e_score_correction_bias``), on tokens [T, hidden]."""

    router: nn.Module
    dim: int = 2
    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    vocab: Optional[int] = None  # the model's vocabulary: token ids for a router that takes them (a hash router)

    def with_token_ids(self, g: torch.Generator, tokens: int, device: torch.device) -> "_RouterCall":
        """The call with random token ids for a router whose forward takes ``input_ids`` and whose block passes
        them (DeepSeek-V4's hash router picks the experts from the model's own token ids), else itself."""
        try:
            signature = inspect.signature(self.router.forward)
        except (TypeError, ValueError):
            return self
        if "input_ids" not in signature.parameters or not self.vocab:
            return self
        bound = signature.bind_partial(None, *self.args, **self.kwargs)
        if "input_ids" not in bound.arguments:  # (its block passes none: the forward would fail, refused in _check)
            return self
        shape = (1,) * (self.dim - 2) + (tokens,)
        bound.arguments["input_ids"] = torch.randint(0, self.vocab, shape, generator=g).to(device)
        return _RouterCall(self.router, self.dim, bound.args[1:], dict(bound.kwargs), self.vocab)

    def __call__(self, hidden: torch.Tensor, others: Optional[Tuple[tuple, dict]] = None) -> Any:
        args, kwargs = others if others is not None else (self.args, self.kwargs)
        return self.router(hidden.reshape((1,) * (self.dim - 2) + tuple(hidden.shape)), *args, **kwargs)

    def others(self, g: torch.Generator) -> Tuple[tuple, dict]:
        """The other arguments with every float in them drawn at random."""

        def drawn(v: Any) -> Any:
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device, v.dtype)
            return 1.7 * v + 0.3 if isinstance(v, float) else v

        return tuple(drawn(a) for a in self.args), {k: drawn(v) for k, v in self.kwargs.items()}


def _as_called(
    where: str, block: nn.Module, router: nn.Module, logits: nn.Module, vocab: Optional[int] = None
) -> _RouterCall:
    """The router as its block calls it, read from one call of the block itself on one token (in eval mode),
    stopped at the router; on the tokens alone when the block cannot be called on the hidden states alone.
    The router's rule reads the hidden states only: a tensor the block passes besides them must be the
    block's own frozen buffer or parameter (one that only chooses experts, which the bank's rule takes from
    the forward's own choice; _check verifies the logits do not depend on it), anything else is refused."""
    weight = logits.weight
    calls: List[_RouterCall] = []

    def seen(module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.append(_RouterCall(router, args[0].dim(), args[1:], kwargs))
        raise Stop()

    x = torch.zeros(1, 1, weight.shape[1], dtype=weight.dtype, device=weight.device)  # (meta too: shapes only)
    handle = router.register_forward_pre_hook(seen, with_kwargs=True)
    try:
        with torch.no_grad(), modes_kept(block):
            block.eval()(x)
    except Exception:  # Stop (the call is recorded), or a block that needs more than the hidden states
        pass
    finally:
        handle.remove()
    call = calls[0] if calls else _RouterCall(router)
    call.vocab = vocab
    owned = {id(t): (n, t.requires_grad) for n, t in [*block.named_parameters(), *block.named_buffers()]}
    for value in [*call.args, *call.kwargs.values()]:
        if not isinstance(value, torch.Tensor):
            continue
        name, trained = owned.get(id(value), (None, False))
        if name is None:
            raise UnsupportedModelError(
                f"{where}: its block passes its router ({type(router).__name__}) a tensor besides the hidden states "
                f"that is not the block's own (computed in the forward), which pipedp's per-sample rule for the "
                f"router does not read: {FREEZE}"
            )
        if trained:
            raise UnsupportedModelError(
                f"{where}: its block passes its router {name}, a trainable tensor that sets which experts a token goes "
                "to (bias balancing), not its output's gradient: freeze it (requires_grad_(False))"
            )
    return call


def _refuse_adapter_states(where: str, outer: nn.Module, bank: nn.Module) -> None:
    """PEFT's LoRA on the bank's weights as privacy/rules/expert_lora.py reads it: one adapter on each of the
    bank's two weights at most, active and unmerged, and no other trainable tensor below the wrappers."""
    dense = is_dense_bank(bank)
    names = DENSE_WEIGHTS if dense else weight_names(bank)
    tensors = [getattr(bank, n) for n in DENSE_WEIGHTS] if dense else [*first_weights(bank), *second_weights(bank)]
    read = {id(p) for p in tensors if p is not None}
    for wrapper in wrappers(outer):
        name = wrapper.parameter_name
        if name not in names or wrapper.get_param().dim() != 3:
            raise UnsupportedModelError(
                f"{where}: LoRA on the experts' {name!r}: pipedp's rule reads adapters on the bank's weights "
                f"{list(names)} ([experts, out, in]) only: target those, or the attention and other Linear layers"
            )
        if wrapper.get_param().requires_grad:
            raise UnsupportedModelError(
                f"{where}: the experts' {name!r} is trained beside its own LoRA adapter, which folds into it for each "
                "call (a gradient autograd cannot give per sample once a later call has folded it again): freeze it "
                f"(requires_grad_(False)), or drop its adapter and train it alone"
            )
        active = list(wrapper.active_adapters)
        if len(active) != 1 or active[0] not in wrapper.lora_A or wrapper.merged or wrapper.disable_adapters:
            raise UnsupportedModelError(
                f"{where}: the LoRA on the experts' {name!r} has adapters {active} active"
                f"{' and merged' if wrapper.merged else ''}{' but disabled' if wrapper.disable_adapters else ''}; "
                "pipedp's rule reads one active, unmerged adapter: model.set_adapter(<one name>), or unmerge it"
            )
        f = factors(wrapper)
        read |= {id(f.a_weight), id(f.b_weight)}
    unread = [n for n, p in outer.named_parameters() if p.requires_grad and id(p) not in read]
    if unread:
        raise UnsupportedModelError(
            f"{where}: {unread} below PEFT's LoRA on the experts are trainable but not read by the active adapters: "
            "freeze them (requires_grad_(False))"
        )


@contextmanager
def _random_factors(outer: nn.Module) -> Iterator[None]:
    """The adapters' factors drawn at random for a check (PEFT starts B at zero, which would check nothing
    about them), restored after."""
    tensors = [t for f in adapted(outer).values() for t in (f.a_weight, f.b_weight)]
    saved = [t.detach().clone() for t in tensors]
    g = torch.Generator(device="cpu").manual_seed(1)
    try:
        with torch.no_grad():
            for t in tensors:
                t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64))
        yield
    finally:
        with torch.no_grad():
            for t, was in zip(tensors, saved):
                t.copy_(was)


def _check(where: str, logits_layer: nn.Module, call: _RouterCall, bank: nn.Module, outer: nn.Module) -> None:
    """The router's first output (``call``: the router as its block calls it) is the logits of
    ``logits_layer`` (the router, or its Linear child), whatever else the block passes it, and the rule reads
    the bank as its own forward does (``outer``, PEFT's LoRA wrapping the bank, with random factors as the
    bank's weights plus their product), on a few random tokens (skipped for weights not loaded yet: the
    self-check compares every checked sample's gradient with its own backward anyway)."""
    router, weight = call.router, logits_layer.weight
    sliced = is_sliced_bank(bank)
    if weight.is_meta or any(w.is_meta for w in (sliced_weights(bank) if sliced else [bank.down_proj])):
        return
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(CHECK_TOKENS, weight.shape[1], generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    call, again = call.with_token_ids(g, CHECK_TOKENS, x.device), call.with_token_ids(g, CHECK_TOKENS, x.device)
    with torch.no_grad(), modes_kept(router, bank):
        router.eval(), bank.eval()
        try:
            out = call(x)
        except Exception as exc:  # a forward that needs more than the hidden states (the token ids)
            passed = [type(v).__name__ for v in [*call.args, *call.kwargs.values()]]
            raise UnsupportedModelError(
                f"{where}: its router ({type(router).__name__}) cannot be called on the hidden states with what its "
                f"block passes it besides them ({passed}): {type(exc).__name__}: {exc}; pipedp's per-sample rule "
                f"for it calls it so: {FREEZE}, or use a model whose router takes the hidden states"
            ) from exc
        if sliced and isinstance(out, torch.Tensor):  # (DBRX's router returns the logits: its block routes them)
            logits = out
            weights, index = _random_routing(g, x, _experts(bank), min(2, _experts(bank)))
        elif isinstance(out, tuple) and len(out) >= 3:
            logits, weights, index = out[0], out[1], out[2]
        else:
            raise UnsupportedModelError(
                f"{where}: its router returns {type(out).__name__}, not (logits, weights, experts): {FREEZE}"
            )
        want = F.linear(x, weight, getattr(logits_layer, "bias", None))
        if not agree(logits.to(want.dtype), want, weight.dtype):
            raise UnsupportedModelError(
                f"{where}: its router's first output is not F.linear(hidden, weight, bias), which pipedp's "
                f"per-sample rule for it assumes: {FREEZE}"
            )
        if (call.args or call.kwargs) and not all(
            torch.allclose(c(x, c.others(g))[0], logits, rtol=1e-6, atol=0) for c in (call, again)
        ):  # (other floats drawn; for a hash router, other token ids too)
            raise UnsupportedModelError(
                f"{where}: its router's logits change with what its block passes it besides the hidden states, which "
                f"pipedp's per-sample rule for the router does not read: {FREEZE}"
            )
        own = bank(x, index, weights).reshape(x.shape)  # (DBRX's bank returns [T, 1, d] for these [T, d])
        try:
            read = recomputed_sliced_output if sliced else recomputed_output
            recomputed = read(bank, x, index, weights)
        except torch.OutOfMemoryError:  # (no answer about the layout)
            raise
        except RuntimeError:  # (the weights' shapes do not fit the layout the flags describe)
            recomputed = None
        if recomputed is None or not agree(recomputed.to(own.dtype), own, own.dtype):
            raise UnsupportedModelError(
                f"{where}: its experts ({type(bank).__name__}) do not compute what pipedp's per-sample rule reads "
                f"from their weights (the fused layout's gate, activation and routing weights): {FREEZE}"
            )
        if outer is not bank:
            _check_adapters(where, outer, bank, (x, index, weights))
    with modes_kept(router), rng_kept(x.device), torch.no_grad():  # (a router sampling its experts in training)
        router.train()
        trained = call(x)
        trained = trained if isinstance(trained, torch.Tensor) else trained[0]
    if not agree(trained.to(want.dtype), want, weight.dtype):
        raise UnsupportedModelError(
            f"{where}: in training its router's first output is not F.linear(hidden, weight, bias), which pipedp's "
            f"per-sample rule for it assumes: {FREEZE}"
        )


def _check_dense(where: str, router: nn.Module, bank: nn.Module, outer: nn.Module) -> None:
    """Llama-4's bank computes what privacy/rules/dense_experts.py reads from its weights, and its router's
    per-sample gradients from the rule are autograd's through its own forward, on a few random tokens
    (skipped for weights not loaded yet: the self-check compares every checked sample's gradient anyway);
    ``outer``: PEFT's LoRA wrapping the bank, checked as _check_adapters does for a routed bank."""
    if router.weight.is_meta or bank.down_proj.is_meta:
        return
    weight = router.weight
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(weight.device, weight.dtype)

    routed = randn(experts_of(bank) * CHECK_TOKENS, weight.shape[1])  # (other tokens for each expert)
    try:
        with torch.no_grad():
            own, recomputed = bank(routed), recomputed_bank_output(bank, routed)
    except (RuntimeError, TypeError) as exc:
        raise UnsupportedModelError(f"{where}: its experts ({type(bank).__name__}) cannot be called as Llama-4's "
                                    f"on the routed tokens alone ({exc}): {FREEZE}") from exc  # fmt: skip
    if not agree(recomputed.to(own.dtype), own, own.dtype):
        raise UnsupportedModelError(
            f"{where}: its experts ({type(bank).__name__}) do not compute what pipedp's per-sample rule reads from "
            f"their weights (per expert, up * act(gate) of x @ gate_up_proj, then @ down_proj): {FREEZE}"
        )
    if outer is not bank:
        _check_dense_adapters(where, outer, bank, routed)
    x = randn(2, CHECK_TOKENS, weight.shape[1])
    try:
        if weight.requires_grad:  # (a frozen router is no layer: no rule reads it)
            _check_router_gradients(where, router, x, randn(2, CHECK_TOKENS, weight.shape[0]))
    except (RuntimeError, TypeError, IndexError) as exc:
        raise UnsupportedModelError(
            f"{where}: its router ({type(router).__name__}) cannot be replayed as one F.linear of its input and "
            f"weight and a function of the logits ({exc}), as pipedp's per-sample rule for it does: {FREEZE}"
        ) from exc
    with modes_kept(router):
        router.train()
        if _draws_random_numbers(router, x[0]):
            raise UnsupportedModelError(f"{where}: its router draws random numbers in training: {FREEZE}")


def _check_router_gradients(where: str, router: nn.Module, x: torch.Tensor, grad_scores: torch.Tensor) -> None:
    """The scoring router's per-sample weight gradients from its rule against autograd's, sample by sample."""
    with torch.no_grad():
        logits = torch.stack([router(x[i])[1] for i in range(x.shape[0])])
        got = SCORING_ROUTER.grads(router, (x, logits), grad_scores)[router.weight]
    for i in range(x.shape[0]):
        with torch.enable_grad():
            (want,) = torch.autograd.grad((router(x[i])[0] * grad_scores[i]).sum(), [router.weight])
        if not agree(got[i].to(want.dtype), want, router.weight.dtype):
            raise UnsupportedModelError(
                f"{where}: pipedp's per-sample gradients of its router ({type(router).__name__}) differ from "
                f"autograd's on random tokens (the router computes more than F.linear of its input and weight "
                f"before the function of the logits it replays): {FREEZE}"
            )


def _check_adapters(where: str, outer: nn.Module, bank: nn.Module, call: tuple) -> None:
    """With random factors: PEFT's forward computes what the rule reads (each weight plus s B_e A_e), and the
    rule's per-sample gradients and norms of every tensor below the wrappers are autograd's, sample by sample
    (PEFT starts B at zero, where A's gradient is zero and the self-check could not tell a wrong one)."""
    if not _trains(outer):
        return
    x, index, weights = call
    named = f"PEFT's LoRA on its experts ({', '.join(w.parameter_name for w in wrappers(outer))})"
    with _random_factors(outer):
        own = outer(x, index, weights)
        try:  # (a PEFT that reads the weights otherwise gives factors of other shapes: refused by name below)
            terms = low_rank(weight_names(bank), adapted(outer), x.dtype)
            recomputed: Optional[torch.Tensor] = recomputed_output(bank, x, index, weights, terms)
        except torch.OutOfMemoryError:  # (no answer about the layout)
            raise
        except RuntimeError:
            recomputed = None
        if recomputed is None or not agree(recomputed.to(own.dtype), own, own.dtype):
            raise UnsupportedModelError(
                f"{where}: {named} does not compute the bank's weights plus s B_e A_e per expert, as pipedp's "
                f"per-sample rule reads its factors: {_adapters_way_out()}"
            )
        n = x.shape[0] // 2 if x.shape[0] >= 2 else 1  # samples of 2 (or 1) tokens
        inputs = tuple(
            t[: 2 * n].reshape(n, -1, *t.shape[1:]) if x.shape[0] >= 2 else t.unsqueeze(0) for t in (x, index, weights)
        )
        wrong = _wrong_per_sample(outer, ADAPTED_EXPERTS, inputs, lambda i, *sample: outer(*sample))
    if wrong:
        raise UnsupportedModelError(
            f"{where}: {named}: pipedp's per-sample gradients of {wrong} differ from autograd's on random tokens: "
            "put the adapters on the attention and other Linear layers (target_modules)"
        )


def _adapters_way_out() -> str:
    """The fix for expert adapters pipedp does not read: a newer PEFT where an older one is installed, and the
    adapters on Linear layers instead."""
    instead = "put the adapters on the attention and other Linear layers (target_modules)"
    try:
        installed = importlib.metadata.version("peft")
    except importlib.metadata.PackageNotFoundError:
        return instead
    if tuple(int(v) for v in re.findall(r"\d+", installed)[:2]) >= PEFT_READ:
        return instead
    wanted = ".".join(map(str, PEFT_READ))
    return (
        f"pip install 'peft>={wanted}' (PEFT {installed} is installed; pipedp reads {wanted}'s factors), or {instead}"
    )


def _trains(outer: nn.Module) -> bool:
    """Some tensor below PEFT's wrappers trains (else they are no layer: no rule reads them, nothing to check)."""
    return any(p.requires_grad for p in outer.parameters())


def _check_dense_adapters(where: str, outer: nn.Module, bank: nn.Module, routed: torch.Tensor) -> None:
    """_check_adapters for Llama-4's bank: with random factors, PEFT's forward on routed tokens [E N, d] computes
    what the rule reads (each weight plus s B_e A_e as stored), and the rule's per-sample gradients and norms
    are autograd's, samples of 2 tokens folded as the capture folds them (sample i's position t E + e)."""
    if not _trains(outer):
        return
    named = f"PEFT's LoRA on its experts ({', '.join(w.parameter_name for w in wrappers(outer))})"
    count = experts_of(bank)
    try:  # (a PEFT that reads the weights otherwise gives factors of other shapes: refused by name below)
        with _random_factors(outer), torch.no_grad():
            own = outer(routed)
            recomputed = recomputed_bank_output(bank, routed, low_rank(DENSE_WEIGHTS, adapted(outer), routed.dtype))
    except torch.OutOfMemoryError:  # (no answer about the layout)
        raise
    except RuntimeError:
        own, recomputed = routed, None
    if recomputed is None or not agree(recomputed.to(own.dtype), own, own.dtype):
        raise UnsupportedModelError(
            f"{where}: {named} does not compute the bank's weights plus s B_e A_e per expert as stored, as "
            f"pipedp's per-sample rule reads its factors: {_adapters_way_out()}"
        )
    tokens = routed.shape[0] // count
    n = tokens // 2

    def folded(t: torch.Tensor) -> torch.Tensor:  # [E N, d] -> [n, 2 E, d]: sample i's tokens 2i, 2i + 1
        return (
            t.reshape(count, tokens, -1)[:, : 2 * n]
            .reshape(count, n, 2, -1)
            .permute(1, 2, 0, 3)
            .reshape(n, 2 * count, -1)
        )

    def call(i: int, x: torch.Tensor) -> torch.Tensor:  # one sample: unfolded, through PEFT's forward, folded
        rows = x.reshape(2, count, -1).transpose(0, 1).reshape(2 * count, -1)
        return outer(rows).reshape(count, 2, -1).transpose(0, 1).reshape(2 * count, -1)

    try:
        with _random_factors(outer):
            wrong = _wrong_per_sample(outer, ADAPTED_DENSE_EXPERTS, (folded(routed),), call)
    except (RuntimeError, IndexError) as exc:  # (factors whose shapes do not fit the reading)
        raise UnsupportedModelError(
            f"{where}: {named}: pipedp's per-sample rule cannot read its factors ({exc}): put the adapters on the "
            "attention and other Linear layers (target_modules)"
        ) from exc
    if wrong:
        raise UnsupportedModelError(
            f"{where}: {named}: pipedp's per-sample gradients of {wrong} differ from autograd's on random tokens: "
            "put the adapters on the attention and other Linear layers (target_modules)"
        )


def _wrong_per_sample(outer: nn.Module, rule, inputs: Tuple[torch.Tensor, ...], call) -> List[str]:
    """The tensors whose per-sample gradients or squared norms from ``rule`` differ from autograd's through
    ``outer``'s own forward (``call(i, *inputs of sample i)``), for random output-gradients (a bank's output
    is as wide as its input)."""
    x, n = inputs[0], inputs[0].shape[0]
    g = torch.Generator(device="cpu").manual_seed(2)
    backprops = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device, x.dtype)
    named = [(name, p) for name, p in outer.named_parameters() if p.requires_grad]
    with torch.no_grad():
        grads = rule.grads(outer, inputs, backprops)
        norms = rule.norms(outer, inputs, backprops) if rule.norms is not None else None
    wrong = []
    for name, p in named:
        want = []
        for i in range(n):
            with torch.enable_grad():
                out = call(i, *(t[i] for t in inputs))
                (grad,) = torch.autograd.grad((out * backprops[i]).sum(), [p], allow_unused=True)
            want.append(torch.zeros_like(p) if grad is None else grad)
        expected = torch.stack(want).to(torch.float64)
        got = grads.get(p)
        close = agree(got.to(torch.float64) if got is not None else None, expected, x.dtype, samples=True)
        if norms is not None and close:  # (a squared norm: twice the gradient's relative difference)
            squared = expected.reshape(n, -1).pow(2).sum(1)
            close = agree(norms[p].to(torch.float64).sqrt(), squared.sqrt(), x.dtype, samples=True)
        if not close:
            wrong.append(name)
    return wrong


def _draws_random_numbers(router: Callable[[torch.Tensor], object], x: torch.Tensor) -> bool:
    """Does the router's forward draw from torch's generator (its state moves)? The state is restored."""

    def state() -> torch.Tensor:
        return torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else torch.get_rng_state()

    with rng_kept(x.device):
        before = state()
        with torch.no_grad():
            router(x)
        return not torch.equal(before, state())
