"""The chunked loss (``train.loss_impl=chunked``, ``mvp_engine/engine/linear_loss.py``) against the full logits'
loss on tiny tensors: the same loss and every gradient (hidden states and each head parameter) for each reduction,
a context-parallel span, a tied head, a LoRA head, soft-capping; per-token log-probabilities equal to
``log_softmax(logits)`` gathered; the model's head checked on every forward; and no ``positions x vocab`` tensor
ever made or kept."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mvp_engine.engine.config import ConfigError
from mvp_engine.engine.linear_loss import HeadInputs, chunked_token_logprobs, chunked_token_loss, project
from mvp_engine.engine.loss import weighted_token_loss
from mvp_engine.kit.mllm.data import IGNORE_INDEX

from .fakes import packed_segments_and_labels

HIDDEN, VOCAB, WIDTH, CHUNK = 16, 37, 11, 4  # 4-row chunks: several per batch, the last one short
TOL = 1e-5


def packed_labels(lengths_per_row, width, seed=0):
    return packed_segments_and_labels(lengths_per_row, width, VOCAB, seed)


SEG, LABELS = packed_labels([[3, 5, 2], [4, 6], [11]], WIDTH)


def linear_head(bias=True, seed=1):
    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, VOCAB, bias=bias)


def hidden_states(rows=3, width=WIDTH, seed=2):
    return torch.randn(rows, width, HIDDEN, generator=torch.Generator().manual_seed(seed), requires_grad=True)


def both_ways(head, hidden, reduction="token", span=None, softcap=None, params=None):
    """(loss, gradients) of the full logits' loss and of the chunked one, over ``hidden`` and ``params``."""
    params = list(head.parameters()) if params is None else params
    results = []
    for chunked in (False, True):
        if chunked:
            part = chunked_token_loss(hidden, head, LABELS, SEG, reduction, span, CHUNK, softcap)
        else:
            part = weighted_token_loss(project(head, hidden, softcap), LABELS, SEG, reduction, span)
        loss = part.weighted_sum / part.weight_total
        grads = torch.autograd.grad(loss, [hidden, *params])
        results.append((loss.detach(), part.weight_total, grads))
    return results


def assert_same(results):
    (loss, total, grads), (chunk_loss, chunk_total, chunk_grads) = results
    assert float(total) == float(chunk_total)
    assert abs(float(chunk_loss - loss)) <= TOL * abs(float(loss))
    for g, c in zip(grads, chunk_grads):
        assert float((c - g).norm()) <= TOL * float(g.norm()), float((c - g).norm() / g.norm())


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
def test_chunked_equals_full_loss_and_gradients(reduction):
    assert_same(both_ways(linear_head(), hidden_states(), reduction))


@pytest.mark.parametrize("span", [(0, 4), (4, 8), (8, 11)])
def test_a_context_parallel_span_equals_that_chunk_of_the_full_loss(span):
    """A CP rank holds positions [start, end) of every row; its last one predicts the next rank's first token."""
    hidden = torch.randn(3, span[1] - span[0], HIDDEN, requires_grad=True)
    assert_same(both_ways(linear_head(), hidden, "sample", span))


def test_a_tied_head_gets_both_gradients():
    """The head's weight is the input embedding (Gemma): its gradient sums the embedding's and the head's."""
    torch.manual_seed(3)
    embedding, head = torch.nn.Embedding(VOCAB, HIDDEN), linear_head(bias=False)
    head.weight = embedding.weight
    ids = torch.randint(0, VOCAB, (3, WIDTH))
    results = []
    for chunked in (False, True):
        hidden = torch.tanh(embedding(ids))
        if chunked:
            part = chunked_token_loss(hidden, head, LABELS, SEG, "square", chunk_tokens=CHUNK)
        else:
            part = weighted_token_loss(head(hidden), LABELS, SEG, "square")
        loss = part.weighted_sum / part.weight_total
        results.append((loss.detach(), part.weight_total, torch.autograd.grad(loss, [embedding.weight])))
    assert_same([(loss, total, grads) for loss, total, grads in results])


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = linear_head()

    def forward(self, x):
        return self.lm_head(self.body(x))


@pytest.mark.parametrize("adapter", ["lora", "modules_to_save"])
def test_a_lora_head_or_a_saved_copy_is_the_module_projected(adapter):
    config = (LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False) if adapter == "lora"
              else LoraConfig(r=4, target_modules=["body"], modules_to_save=["lm_head"]))
    model = get_peft_model(TinyLM(), config)
    head = model.base_model.model.lm_head
    trainable = [p for p in head.parameters() if p.requires_grad]
    assert trainable
    hidden = hidden_states()
    assert_same(both_ways(head, hidden, "token", params=trainable))


class MatmulsInBackward(TorchDispatchMode):
    """How many matrix products run while inside."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
        return func(*args, **(kwargs or {}))


def test_a_plain_linear_head_takes_its_gradients_in_the_forward():
    """A plain linear head (its weight and bias trained, or frozen) is fused: the backward only scales what the
    forward kept, no matrix product; a LoRA-wrapped head is called as a module and recomputes its logits."""
    head = linear_head()
    lora = get_peft_model(TinyLM(), LoraConfig(r=4, target_modules=["lm_head"])).base_model.model.lm_head
    frozen = linear_head().requires_grad_(False)
    for module, products in ((head, 0), (frozen, 0), (lora, 1)):
        hidden = hidden_states()
        part = chunked_token_loss(hidden, module, LABELS, SEG, "sample", chunk_tokens=CHUNK)
        with MatmulsInBackward() as counted:
            part.weighted_sum.backward()
        assert (counted.count > 0) == bool(products), (module, counted.count)
    assert_same(both_ways(frozen, hidden_states(), "square", params=[]))  # the rows' gradient alone


def test_soft_capping_is_reproduced():
    assert_same(both_ways(linear_head(), hidden_states() * 4, "sample", softcap=2.0))


def test_bf16_autocast_matches_within_bf16_logits():
    """Under autocast both project in bf16 and take the cross-entropy of those logits in fp32."""
    head, hidden = linear_head(), hidden_states()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = weighted_token_loss(head(hidden), LABELS, SEG, "token")
        chunked = chunked_token_loss(hidden, head, LABELS, SEG, "token", chunk_tokens=CHUNK)
    assert float(chunked.weighted_sum.detach()) == pytest.approx(float(full.weighted_sum.detach()), rel=1e-5)


def test_token_logprobs_are_log_softmax_gathered():
    head, hidden = linear_head(), hidden_states()
    for span in (None, (3, 9)):
        part = hidden if span is None else hidden[:, span[0]:span[1]]
        logprobs = chunked_token_logprobs(part, head, LABELS, span, CHUNK)
        targets = LABELS[:, 1:] if span is None else torch.cat(
            [LABELS[:, 1:], torch.full((3, 1), IGNORE_INDEX)], 1)[:, span[0]:span[1]]
        logits = head(part if span else part[:, :-1]).float()
        expected = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        expected = expected.where(targets != IGNORE_INDEX, 0.0)
        assert logprobs.shape == targets.shape
        torch.testing.assert_close(logprobs, expected, rtol=TOL, atol=1e-6)
        # differentiable: the same gradient as through log_softmax
        weights = torch.arange(targets.numel(), dtype=torch.float32).reshape(targets.shape)
        ours = torch.autograd.grad((logprobs * weights).sum(), hidden)[0]
        theirs = torch.autograd.grad((expected * weights).sum(), hidden)[0]
        torch.testing.assert_close(ours, theirs, rtol=TOL, atol=1e-6)


def test_nothing_supervised_still_reaches_the_head_with_zero_gradients():
    """A micro-batch with no supervised token: the loss is 0 and the head still takes part in the backward."""
    model = TinyLM()
    inputs, labels = torch.randn(1, 5, HIDDEN), torch.full((1, 5), IGNORE_INDEX)
    with HeadInputs(FakeModel(model)) as head:
        logits = model(inputs)
    part = head.loss(logits, labels, torch.zeros(1, 5, dtype=torch.long), "token")
    part.weighted_sum.backward()
    assert float(part.weighted_sum) == 0 and float(part.weight_total) == 0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


class FakeModel(torch.nn.Module):
    """A transformers-like wrapper: ``get_output_embeddings`` and a config with a text config."""

    def __init__(self, inner, softcap=None, applied=None):
        super().__init__()
        self.inner, self.applied = inner, applied
        text = type("TextConfig", (), {"final_logit_softcapping": softcap})()
        self.config = type("Config", (), {"get_text_config": lambda self: text})()

    def get_output_embeddings(self):
        return self.inner.lm_head

    def forward(self, x):
        logits = self.inner(x)
        return logits if self.applied is None else torch.tanh(logits / self.applied) * self.applied


def test_the_head_is_checked_against_the_models_logits():
    model = FakeModel(TinyLM(), softcap=None, applied=0.5)  # the model caps its logits; its config says nothing
    inputs = torch.randn(2, 6, HIDDEN)
    with HeadInputs(model) as head:
        logits = model(inputs)
    assert logits.shape == (2, 1, VOCAB)  # the model projected each row's first position only
    with pytest.raises(ConfigError, match="train.loss_impl=chunked: FakeModel's logits are not its output head's "
                                          "projection with no soft-capping .*use train.loss_impl=full"):
        head.loss(logits, torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long), "token")
    capped = FakeModel(model.inner, softcap=0.5, applied=0.5)
    with HeadInputs(capped) as head:
        logits = capped(inputs)
    labels = torch.randint(0, VOCAB, (2, 6))
    part = head.loss(logits, labels, torch.zeros(2, 6, dtype=torch.long), "token")
    full = weighted_token_loss(capped(inputs), labels, torch.zeros(2, 6, dtype=torch.long), "token")
    assert float(part.weighted_sum) == pytest.approx(float(full.weighted_sum), rel=TOL)


def test_a_head_with_dropout_is_refused():
    model = get_peft_model(TinyLM(), LoraConfig(r=4, target_modules=["lm_head"], lora_dropout=0.1))
    with pytest.raises(ConfigError, match="the output head has dropout"):
        HeadInputs(FakeModel(model.base_model.model))


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op makes (forward and backward), in bytes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


class SavedBytes:
    """Bytes autograd keeps for backward (each storage once), as ``tools/bench_memory.py`` counts them."""

    def __init__(self):
        self.bytes, self.largest, self._seen = 0, 0, {}

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen[storage.data_ptr()] = tensor
            self.bytes += storage.nbytes()
            self.largest = max(self.largest, storage.nbytes())
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)


def test_no_positions_by_vocab_tensor_is_made_or_kept():
    """At a 32k vocabulary and 1024 positions: the full loss keeps fp32 logits and log-softmax (4 bytes x L x V
    each); the chunked loss keeps the rows' gradient and the head weight's (fp32, V x H: the head's own size, which
    its gradient takes anyway), and no op makes a tensor larger than one chunk's fp32 logits."""
    vocab, width, hidden_size, chunk = 32768, 1024, 8, 64
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    hidden = torch.randn(1, width, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, width))
    labels[:, : width // 2] = IGNORE_INDEX  # the first half unsupervised (a prompt, an image)
    seg = torch.zeros(1, width, dtype=torch.long)
    measured = {}
    for name in ("full", "chunked"):
        saved, largest = SavedBytes(), LargestTensor()
        with saved.hooks(), largest:
            if name == "full":
                part = weighted_token_loss(head(hidden), labels, seg, "token")
            else:
                part = chunked_token_loss(hidden, head, labels, seg, "token", chunk_tokens=chunk)
        with largest:
            part.weighted_sum.backward()
        measured[name] = (saved.bytes, saved.largest, largest.largest)
    full_saved, _, full_largest = measured["full"]
    chunked_saved, chunked_saved_largest, chunked_largest = measured["chunked"]
    positions_by_vocab = width * vocab * 4
    assert full_saved >= positions_by_vocab and full_largest >= positions_by_vocab
    head_gradient = vocab * hidden_size * 4
    # the head's gradient, the gather's indices and a few rows of floats
    assert chunked_saved < head_gradient + width * hidden_size * 4 * 4, measured
    assert chunked_saved_largest <= head_gradient
    assert chunked_largest <= chunk * vocab * 4, measured


def test_a_training_with_the_chunked_loss_logs_what_the_full_loss_logs(tmp_path):
    """Gemma 4's tiny model (tied head, final_logit_softcapping 30) trains and evaluates the same with either loss:
    every step's loss and gradient norm and the eval loss within 1e-5 relative, chunks of 16 positions."""
    import mvp_engine.engine.testing as kit

    data = kit.shared_mixed_jsonl()
    common = [*kit.packing_overrides("greedy"), f"data.sources=[{data}]", f"data.eval_sources=[{data}]",
              "data.shuffle=false", "data.max_seq_len=160", "train.epochs=2", "train.micro_batch_size=1",
              "train.gradient_accumulation_steps=2", "train.learning_rate=5e-3", "train.loss_reduction=sample",
              "train.loss_chunk_tokens=16"]
    for impl in ("full", "chunked"):
        kit.train("gemma4", tmp_path / impl, [*common, f"train.loss_impl={impl}"])
    full, chunked = kit.read_metrics(tmp_path / "full"), kit.read_metrics(tmp_path / "chunked")
    assert len(full) == len(chunked) and any("eval_loss" in m for m in full)
    for a, b in zip(full, chunked):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a:
                assert abs(b[key] - a[key]) <= 1e-5 * abs(a[key]), (key, a, b)
