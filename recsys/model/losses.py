"""Next-item losses: the full softmax over the catalog, and a sampled softmax with a log-q correction.

The full softmax scores every position against every item: ``T x N x D`` multiply-adds a step, and a
``T x N`` logit matrix held for the backward pass. At tens of thousands of items that is affordable and
the best loss we know for these models (docs/quality.md); beyond ~100k items it dominates the step
(at 200k items and 800 targets a step, the logits alone are 640 MB). The sampled softmax replaces the
catalog by ``negatives`` items drawn once per step from a proposal ``q`` and shared by every target of
the batch, so the cost is ``T x negatives x D`` whatever the catalog size.

Drawing negatives from ``q`` rather than uniformly favours the items the model must learn to rank
below the target (popular ones), but a plain softmax over them would then learn scores shifted by
``log q``: popular items over-represented as negatives end up under-scored. The log-q correction
(Bengio & Senecal 2008; Yi et al. 2019, "Sampling-bias-corrected neural modeling") subtracts from
each candidate's logit the log of its expected count among the candidates, which turns the
softmax's denominator into an importance-sampling estimate of the full one: as ``negatives`` grows,
the sampled loss converges to the full softmax's loss and gradient (tests/test_losses.py checks
this against a skewed proposal, where dropping the correction fails).

Pure torch: no Spark, MLflow or configuration objects.
"""
from __future__ import annotations

import logging
import math
from functools import partial
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LOSSES = ("full", "sampled")
PROPOSAL_POWER = 0.75
PROPOSAL_SMOOTHING = 1.0

LossFunction = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def full_softmax_loss(hidden: torch.Tensor, items: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's target against every item.

    ``hidden`` [T, D] hidden states, ``items`` [N, D] item embeddings (padding row left out),
    ``targets`` [T] 0-based item indices into ``items``.

    On CPU, when a gradient is wanted and the logits are more than one block (``CHUNK_LOGITS``), the loss
    and its gradient are computed together, a block of rows at a time (:class:`_ChunkedSoftmaxCrossEntropy`):
    the same values as ``F.cross_entropy(hidden @ items.T, targets)`` up to rounding, without the
    ``[T, N]`` logits, their log-softmax and the backward pass's ``[T, N]`` gradient ever held whole,
    which is most of the loss's time there (at 9.7k items an epoch a quarter to a third shorter:
    docs/performance.md). Logits that fit one block (a catalog of up to about 2,500 items at the default
    batch) gain nothing from it and keep the one-piece form, as a GPU does: there many small blocks would
    launch many kernels, and that trade was not measured on one.
    """
    if (hidden.device.type == "cpu" and hidden.shape[0] * items.shape[0] > CHUNK_LOGITS
            and torch.is_grad_enabled() and (hidden.requires_grad or items.requires_grad)):
        return _ChunkedSoftmaxCrossEntropy.apply(hidden, items, targets)
    return F.cross_entropy(hidden @ items.T, targets)                            # [T, N] logits


CHUNK_LOGITS = 1 << 21      # logits per block of rows (8 MB in fp32); 1M and 4M were within the noise of it at 9.7k and
                            # 50k items, and a smaller block's dozen or so operations cost more than they save below ~5k
MIN_CHUNK_ROWS = 64         # at huge catalogs, still enough rows that each block's products read the items once for
                            # many rows


class _ChunkedSoftmaxCrossEntropy(torch.autograd.Function):
    """The full softmax's mean cross-entropy, its gradient computed in the forward pass, block by block.

    For one row, the gradient of ``logsumexp(s) - s_y`` with respect to the logits ``s`` is
    ``softmax(s) - onehot(y)``; the hidden state's and the items' gradients follow by two products with
    it. So each block's logits are computed, turned into that gradient in place and multiplied back at
    once, and only the ``[T, D]`` and ``[N, D]`` gradients are kept for :meth:`backward`, which scales
    them by the incoming gradient (the loss is a scalar). Autocast applies to the products as it would
    to ``hidden @ items.T`` (bf16 where training chose it); the softmax runs in fp32, as autocast runs
    ``cross_entropy``. Not twice differentiable (training never asks).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, items: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device = hidden.device
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
        rows = max(MIN_CHUNK_ROWS, CHUNK_LOGITS // items.shape[0])        # called with more than one block's logits
        total = torch.zeros((), dtype=torch.float64, device=device)
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device)
        grad_items = torch.zeros(items.shape, dtype=torch.float32, device=device)
        with torch.autocast(device.type, enabled=False):       # cast once here, not per product as autocast would
            weights, states = items.to(dtype), hidden.to(dtype)                  # [N, D], [T, D]
            # one [c, N] buffer for every block (two in bf16): a fresh array of megabytes is a fresh mapping from
            # the allocator, whose first touch (page faults) costs more than the arithmetic that fills it
            fp32 = dtype == torch.float32
            scores = torch.empty((min(rows, hidden.shape[0]), items.shape[0]), dtype=dtype, device=device)
            floats = scores if fp32 else torch.empty_like(scores, dtype=torch.float32)     # where the softmax runs
            for start in range(0, hidden.shape[0], rows):
                block = states[start:start + rows]                               # [c, D]
                c = len(block)
                target = targets[start:start + rows, None]                       # [c, 1]
                logits = torch.mm(block, weights.T, out=scores[:c])              # [c, N] in the products' dtype
                probs = floats[:c] if fp32 else floats[:c].copy_(logits)         # [c, N] fp32
                top = probs.amax(1, keepdim=True)                                # [c, 1] for a stable exp
                picked = probs.gather(1, target)                                 # [c, 1] the targets' logits
                probs.sub_(top).exp_()                                           # in place
                norm = probs.sum(1, keepdim=True)
                total += (norm.log() + top - picked).sum(dtype=torch.float64)    # sum of logsumexp - s_y
                probs.div_(norm).scatter_add_(1, target, torch.full_like(picked, -1.0))   # softmax - onehot
                delta = probs if fp32 else scores[:c].copy_(probs)               # back in the products'
                grad_hidden[start:start + rows] = delta @ weights                # dtype, through both products
                if fp32:
                    grad_items.addmm_(delta.T, block)
                else:
                    grad_items += delta.T @ block
        count = hidden.shape[0]
        ctx.save_for_backward(grad_hidden.div_(count), grad_items.div_(count))
        ctx.dtypes = (hidden.dtype, items.dtype)
        return (total / count).float()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_hidden, grad_items = ctx.saved_tensors
        return ((grad_hidden * grad_loss).to(ctx.dtypes[0]), (grad_items * grad_loss).to(ctx.dtypes[1]), None)


def item_log_q(counts: torch.Tensor | np.ndarray, power: float = PROPOSAL_POWER,
               smoothing: float = PROPOSAL_SMOOTHING) -> torch.Tensor:
    """[N] float32 log-probabilities of the proposal: ``(count + smoothing) ** power``, normalised.

    ``counts`` [N] is how often each item occurs in the training sequences. Why these defaults:

    - ``smoothing`` 1 (add-one): every item of the vocabulary keeps a non-zero probability, so its
      embedding is pushed down now and then even if it is never a target in this window of data
      (a user's first item never is), and ``log q`` stays finite for the correction.
    - ``power`` 0.75, as word2vec's negative sampling: between uniform (0) and the unigram
      distribution (1). Unigram is closest to the model's average prediction, so it has the lowest
      bias at few negatives, but on a long-tailed catalog it almost never draws tail items, and
      when it does their correction weight ``1 / (n q)`` is huge (high variance). 0.75 draws the
      head most of the time and the tail often enough; the correction keeps the estimate
      consistent for any power.
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    if counts.dim() != 1 or len(counts) == 0:
        raise ValueError(f"counts must be a non-empty [num_items] vector, got shape {tuple(counts.shape)}")
    if bool((counts < 0).any()):
        raise ValueError(f"counts must be non-negative, got a minimum of {float(counts.min())}")
    if not 0 <= power <= 1 or smoothing < 0:
        raise ValueError(f"power must be in [0, 1] and smoothing >= 0, got power={power}, smoothing={smoothing}")
    weights = (counts + smoothing) ** power                                      # [N]
    if not bool((weights > 0).all()):
        raise ValueError("with smoothing=0, every item needs a count above 0 (an item with q = 0 could never be "
                         "sampled and its log q is -inf): pass smoothing > 0")
    return (weights / weights.sum()).log().float()


def sampled_softmax_loss(hidden: torch.Tensor, items: torch.Tensor, targets: torch.Tensor, log_q: torch.Tensor,
                         negatives: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Mean cross-entropy of each target against ``negatives`` items sampled from ``q``, log-q corrected.

    One set of ``negatives`` indices is drawn per call, with replacement, from ``exp(log_q)`` with
    ``generator`` (seeded by the caller, so training is reproducible), and shared by every row:
    one ``[T, negatives]`` matrix product instead of ``[T, N]``.

    Each candidate's logit is corrected by the log of its expected count in the candidate set:
    a sampled item ``j`` is expected ``negatives * q_j`` times, the positive is there exactly once
    (``log 1 = 0``). A sampled item equal to the row's target (an accidental hit) is masked out:
    the positive already counts it exactly. The denominator is then ``exp(s_y)`` plus an unbiased
    importance-sampling estimate of the sum over the other items, so the loss tends to the full
    softmax's as ``negatives`` grows (the log makes it slightly low at few negatives).

    Not TensorFlow's ``sampled_softmax_loss`` convention, which subtracts ``log(n q_y)`` from the
    positive too: with accidental hits removed that converges to ``-s_y + log(e^{s_y} + n q_y Z)``,
    not to the full softmax.
    """
    if negatives < 1:
        raise ValueError(f"negatives must be at least 1, got {negatives}")
    if log_q.shape != (items.shape[0],):
        raise ValueError(f"log_q has shape {tuple(log_q.shape)}, but there are {items.shape[0]} items: "
                         "build it from counts of the same vocabulary (item_log_q)")
    sampled = torch.multinomial(log_q.exp(), negatives, replacement=True, generator=generator)   # [S]
    positive = (hidden * items[targets]).sum(-1, keepdim=True)                   # [T, 1]
    correction = log_q[sampled] + math.log(negatives)                            # [S] log expected count
    negative = hidden @ items[sampled].T - correction.to(hidden.dtype)           # [T, S]
    negative = negative.masked_fill(sampled[None, :] == targets[:, None], float("-inf"))
    logits = torch.cat([positive, negative], dim=1)                              # [T, 1 + S]
    return F.cross_entropy(logits, torch.zeros(len(targets), dtype=torch.long, device=logits.device))


def vocabulary_counts(index_counts: np.ndarray | torch.Tensor, num_items: int) -> torch.Tensor:
    """[num_items] counts of items 1..num_items from a bincount over item indices (index 0: padding).

    A bincount is as long as the largest index seen plus one; items never seen count 0 (the
    proposal's smoothing still gives them a chance to be drawn).
    """
    counts = torch.as_tensor(np.asarray(index_counts), dtype=torch.float64)
    if counts.dim() != 1 or len(counts) > num_items + 1:
        raise ValueError(f"index counts must be a vector of at most num_items + 1 = {num_items + 1} entries "
                         f"(index 0 is padding), got shape {tuple(counts.shape)}")
    return torch.nn.functional.pad(counts, (0, num_items + 1 - len(counts)))[1:]


def training_loss(kind: str, negatives: int, counts: torch.Tensor, *, seed: int,
                  device: str | torch.device = "cpu") -> LossFunction:
    """The loss ``fit`` calls each step, ``(hidden [T, D], items [N, D], targets [T]) -> scalar``, chosen once.

    ``counts`` [N] are the training sequences' item counts (the proposal of "sampled"); ``seed`` seeds the
    negatives' generator, on ``device`` (a CUDA tensor needs a CUDA generator), apart from every other
    random stream of training. With ``negatives >= N`` a sampled softmax costs as much as the full one
    or more and only approximates it, so "sampled" falls back to "full" and logs why, rather than
    failing a nightly training whose catalog shrank below ``negatives``.
    """
    if kind not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {kind!r}")
    if kind == "full":
        return full_softmax_loss
    if negatives < 1:
        raise ValueError(f"negatives must be at least 1, got {negatives}")
    num_items = len(counts)
    if negatives >= num_items:
        log.warning("loss 'sampled' with %d negatives but only %d items: training with the full softmax instead "
                    "(exact, and no slower); lower train.negatives below the item count to sample",
                    negatives, num_items)
        return full_softmax_loss
    device = torch.device(device)
    generator = torch.Generator(device=device)
    generator.manual_seed(int(np.random.SeedSequence([seed, 21]).generate_state(1)[0]))
    log_q = item_log_q(counts).to(device)
    return partial(sampled_softmax_loss, log_q=log_q, negatives=negatives, generator=generator)
