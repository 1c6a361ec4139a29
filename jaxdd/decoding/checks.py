"""Input checks for the host API and the decoder, in numpy on the host:
inside a jit XLA would silently clamp an out-of-range id or position, or wrap
it. Each failure is an ``InputError`` naming the field and the limit.

A request (``RowRequest``) is checked once, for the pool that runs it, by ``check_request``,
whoever made it (the server from an HTTP body, ``generate_batch`` from its arguments): its errors
name the fields and limits in the caller's ``Words`` and say why it was refused."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxdd.cache import Paging, cache_slots
from jaxdd.config import KimiConfig
from jaxdd.decoding.requests import Decoder, RowRequest, RowShape
from jaxdd.decoding.sampling import Sampling
from jaxdd.errors import InputError, RequestRefused
from jaxdd.runtime.buckets import prompt_bucket, round_tiers
from jaxdd.types import METHODS, TREE_LOGITS, Method, TreeLogits, verified_tokens

# stop ids are padded to this many so their number never changes a compiled shape
MAX_STOP_TOKENS = 16


def check_tokens(
    token_ids, vocab_size: int, batch: int | None = None, field: str = "token_ids"
) -> np.ndarray:
    """Token ids as an int32 [batch, T] array (one sequence may be given flat); an error names
    them ``field``."""
    tokens = np.asarray(token_ids)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not np.issubdtype(tokens.dtype, np.integer):
        raise InputError.at(
            field, f"expected a non-empty [batch, T] integer array, got shape {tokens.shape}"
        )
    if batch is not None and tokens.shape[0] != batch:
        raise InputError.at(
            field, f"batch {tokens.shape[0]} does not match the cache batch {batch}"
        )
    bad = np.argwhere((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise InputError.at(
            field, f"id {tokens[at]} at {at} outside the vocabulary [0, {vocab_size})"
        )
    return tokens.astype(np.int32)


def check_positions(
    positions, shape: tuple[int, int], slots: int, max_positions: int
) -> np.ndarray:
    """Positions as int32 of ``shape``, each inside the cache and the model's position range."""
    positions = np.asarray(positions)
    if positions.shape != shape or not np.issubdtype(positions.dtype, np.integer):
        raise InputError.at(
            "positions",
            f"expected integers of shape {shape}, got {positions.dtype} {positions.shape}",
        )
    bad = np.argwhere((positions < 0) | (positions >= min(slots, max_positions)))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        raise InputError.at(
            "positions",
            f"{positions[at]} at {at} is beyond the cache ({slots} slots) or the model's "
            f"max_position_embeddings ({max_positions})",
        )
    return positions.astype(np.int32)


def check_visible(visible, batch: int, tokens: int) -> np.ndarray:
    """The new tokens' visibility mask [batch, T, T]
    (default causal); every token must see itself."""
    if visible is None:
        return np.broadcast_to(np.tril(np.ones((tokens, tokens), bool)), (batch, tokens, tokens))
    visible = np.asarray(visible)
    if visible.shape != (batch, tokens, tokens) or visible.dtype != bool:
        expected = (batch, tokens, tokens)
        raise InputError.at(
            "visible",
            f"expected a bool mask of shape {expected}, got {visible.dtype} {visible.shape}",
        )
    if not visible[:, np.arange(tokens), np.arange(tokens)].all():
        raise InputError.at(
            "visible", "every new token must see itself (the diagonal must be True)"
        )
    return visible


def per_request(name: str, value, count: int) -> list:
    """One value for all ``count`` requests, or a list with one each."""
    values = list(value) if isinstance(value, list | tuple) else [value] * count
    if len(values) != count:
        raise InputError.at(name, f"give one per prompt ({count}), or one for all")
    return values


def check_round_options(
    method: str,
    has_drafter: bool,
    drafter_block: int | None,
    block_size: int | None,
    budget: int | None,
    max_children: int | None,
) -> tuple[int, int | None]:
    """(block, budget) for a method: block 1 for AR, the drafter's block
    by default, and a DDTree budget of block - 1 nodes by default."""
    if method not in METHODS:
        raise InputError.at("method", f"expected 'ar', 'dflash' or 'ddtree', got {method!r}")
    if method == "ar":
        return 1, None
    if not has_drafter:
        raise InputError(f"method {method!r} needs a drafter", field="method")
    block = drafter_block if block_size is None else block_size
    if block < 2:
        raise InputError.at("block_size", f"must be >= 2, got {block}")
    if method == "dflash":
        return block, None
    budget = block - 1 if budget is None else budget
    if budget < 1:
        raise InputError.at("budget", f"must be >= 1, got {budget}")
    if max_children is not None and max_children < 1:
        raise InputError.at("max_children", f"must be >= 1, got {max_children}")
    return block, budget


def check_tree_logits(tree_logits: str) -> TreeLogits:
    if tree_logits not in TREE_LOGITS:
        raise InputError.at(
            "tree_logits", f"expected one of {', '.join(TREE_LOGITS)}, got {tree_logits!r}"
        )
    return tree_logits


@dataclasses.dataclass(frozen=True)
class Words:
    """A caller's words for what ``check_request`` names: the request's fields (an error's
    ``field``) and the limits of the pool that runs it (said in its messages)."""

    prompt: str = "prompt"
    max_new_tokens: str = "max_new_tokens"
    stop_ids: str = "stop_ids"
    logprobs: str = "logprobs"
    max_len: str = "the pool's max_len"  # the limit on prompt + new tokens
    max_prompt: str = "the pool's max_prompt"
    max_logprobs: str = "the pool's max_logprobs"


OWN_WORDS = Words()  # jaxdd's own: ``RowRequest``'s fields, ``RowShape``'s limits


def check_request(
    request: RowRequest,
    shape: RowShape,
    config: KimiConfig,
    words: Words = OWN_WORDS,
    always: tuple[int, ...] = (),
) -> RowRequest:
    """``request`` checked for a pool of ``shape``, its stop ids those it asks for and the
    caller's ``always`` ones (its lists copied): else ``RequestRefused`` naming the field in the
    caller's ``words``, and why ("too_long": past the pool's lengths)."""
    prompt, max_new_tokens, logprobs = request.prompt, request.max_new_tokens, request.logprobs
    try:
        tokens = check_tokens([prompt], config.vocab_size, field=words.prompt)[0]
    except InputError as error:
        raise RequestRefused(str(error), words.prompt) from None
    too_long = lambda field, detail: RequestRefused(f"{field}: {detail}", field, "too_long")
    invalid = lambda field, detail: RequestRefused(f"{field}: {detail}", field)
    if len(prompt) > shape.max_prompt:
        detail = f"{len(prompt)} tokens, at most {shape.max_prompt} ({words.max_prompt})"
        raise too_long(words.prompt, detail)
    most = shape.spec.top_logprobs
    if logprobs is not None and not most:
        raise invalid(words.logprobs, f"this pool computes none ({words.max_logprobs} 0)")
    if logprobs is not None and not (isinstance(logprobs, int) and 0 <= logprobs <= most):
        raise invalid(words.logprobs, f"must be an integer in [0, {most}], got {logprobs!r}")
    if request.score_prompt and logprobs is None:
        raise invalid(words.logprobs, "scoring the prompt needs logprobs")
    least = 0 if request.score_prompt else 1
    if not isinstance(max_new_tokens, int) or max_new_tokens < least:
        detail = f"must be an integer >= {least}, got {max_new_tokens!r}"
        raise invalid(words.max_new_tokens, detail)
    if len(prompt) + max_new_tokens > shape.max_len:
        after = f"{max_new_tokens} after a prompt of {len(prompt)} tokens"
        raise too_long(words.max_new_tokens, f"{after} exceeds {words.max_len} {shape.max_len}")
    stop_ids = _stop_ids(request.stop_ids, always, config.vocab_size, words.stop_ids)
    if not isinstance(request.sampling, Sampling):
        raise invalid("sampling", "expected a jaxdd.Sampling")
    return dataclasses.replace(request, prompt=tokens.tolist(), stop_ids=stop_ids)


def _stop_ids(asked: list[int], always: tuple[int, ...], vocab_size: int, field: str) -> list[int]:
    """The ids a request stops at: its own and ``always``, at most ``MAX_STOP_TOKENS``, each in
    the vocabulary (a negative id never stops anything: -1 says so on purpose)."""
    stop_ids = sorted(set(always) | set(asked))
    if len(stop_ids) > MAX_STOP_TOKENS:
        own = len(set(always))
        added = len(stop_ids) - own
        beside = f" beside this model's {own} own" if own else ""
        detail = f"at most {MAX_STOP_TOKENS - own}{beside}, got {added}"
        raise RequestRefused(f"{field}: {detail}", field)
    outside = [s for s in stop_ids if s >= vocab_size]
    if outside:
        detail = f"{outside[0]} outside the vocabulary [0, {vocab_size})"
        raise RequestRefused(f"{field}: {detail}", field)
    return stop_ids


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    """What a pool of rows is asked for, each field checked by ``pool_shape``."""

    method: Method
    rows: int
    max_len: int  # prompt + new tokens, per request
    max_prompt: int | None = None  # default: max_len - 1
    block_size: int | None = None  # default: the drafter's
    budget: int | None = None  # DDTree nodes per round, default block_size - 1
    max_children: int | None = None
    max_logprobs: int = 0  # > 0: every round reports logprobs, a request asks for at most these
    cache_tokens: int | None = None  # the pool of pages' tokens, default every row's max_len
    prefill_chunk: int | None = None  # a longer prompt is prefilled in parts of this many tokens
    trace: int = 0  # > 0: every round reports its drafts' top this many
    tree_logits: TreeLogits = "scaled"
    # An offline batch's one round, sampled or greedy as its requests are, over every row, its
    # rows' slots in a length bucket (its requests' lengths vary); None: a server's sampled and
    # greedy rounds per tier, its rows' slots its max_len's.
    batch_sampled: bool | None = None


def pool_shape(decoder: Decoder, options: PoolOptions) -> RowShape:
    """A ``RowPool``'s shape from its ``options``, each checked (``InputError`` naming it)."""
    config, method, rows, max_len = decoder.config, options.method, options.rows, options.max_len
    if rows < 1:
        raise InputError.at("rows", f"must be >= 1, got {rows}")
    if not 2 <= max_len <= config.max_position_embeddings:
        raise InputError.at(
            "max_len", f"must be in [2, {config.max_position_embeddings}], got {max_len}"
        )
    max_prompt = max_len - 1 if options.max_prompt is None else options.max_prompt
    if not 1 <= max_prompt < max_len:
        raise InputError.at("max_prompt", f"must be in [1, max_len), got {max_prompt}")
    drafter_block = None if decoder.drafter is None else decoder.drafter.config.block_size
    has_drafter = decoder.drafter is not None
    asked = (options.block_size, options.budget, options.max_children)
    block, budget = check_round_options(method, has_drafter, drafter_block, *asked)
    chunk = options.prefill_chunk
    if chunk is not None and not (isinstance(chunk, int) and 1 <= chunk <= max_prompt):
        raise InputError.at(
            "prefill_chunk", f"must be in [1, max_prompt {max_prompt}], got {chunk!r}"
        )
    for name in ("max_logprobs", "trace"):
        if not isinstance(value := getattr(options, name), int) or value < 0:
            raise InputError.at(name, f"must be an integer >= 0, got {value!r}")
    round_options = {
        "block": block,
        "budget": budget,
        "max_children": options.max_children,
        "trace": options.trace,
        "tree_logits": check_tree_logits(options.tree_logits),
        "top_logprobs": options.max_logprobs,
    }
    if options.batch_sampled is None:
        spec = decoder.round_spec(method, sampled=True, **round_options)
        greedy_spec = decoder.round_spec(method, sampled=False, **round_options)
        tiers, slots = round_tiers(rows), max_len
    else:
        spec = decoder.round_spec(method, sampled=options.batch_sampled, **round_options)
        greedy_spec, tiers, slots = spec, (rows,), cache_slots(max_len)
    round_tokens = max(block, verified_tokens(method, block, budget))
    paging = Paging.for_rows(spec.stripes, rows, prompt_bucket(max_prompt), slots, round_tokens)
    least = min(max_len + round_tokens, paging.slots)  # one request of max_len: none waits forever
    if options.cache_tokens is not None:
        if not isinstance(options.cache_tokens, int) or options.cache_tokens < least:
            raise InputError.at(
                "cache_tokens",
                f"must hold one request of max_len {max_len} and a round ({least} tokens), "
                f"got {options.cache_tokens!r}",
            )
        paging = paging.holding(options.cache_tokens)
    return RowShape(spec, greedy_spec, rows, max_len, max_prompt, tiers, paging, chunk)
