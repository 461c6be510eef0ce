"""``train.loss_impl=liger | cce`` on a CPU machine: what can be checked without their Triton kernels.

Checked: each is refused in one line without CUDA; a head the kernels cannot take (a LoRA-adapted head, a bias) is
refused naming ``chunked``; a missing package names its extra and a Liger older than the per-token-weight fix is
refused; and the glue around a kernel (the supervised rows of the CP span, the token / sample / square weights)
gives the chunked loss's result and gradients when the kernel is replaced by a torch cross-entropy with the
kernels' contract (per-token losses, ``reduction="none"``). The kernels themselves are compared with ``chunked``
on a GPU: ``tools/gpu_check.py --only fused-losses``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from mvp_engine.engine import gpu_losses
from mvp_engine.engine.config import ConfigError, TrainSpec
from mvp_engine.engine.gpu_losses import check_head, fused_token_loss
from mvp_engine.engine.linear_loss import chunked_token_loss, supervised_rows

from .fakes import packed_segments_and_labels

HIDDEN, VOCAB, WIDTH = 16, 37, 11
SEG, LABELS = packed_segments_and_labels([[3, 5, 2], [4, 6], [11]], WIDTH, VOCAB)


@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_without_cuda_the_fused_losses_are_refused_with_one_line(impl):
    with pytest.raises(ConfigError, match=rf"^train.loss_impl='{impl}' needs a CUDA GPU \(its fused kernel is "
                                          r"Triton, which does not run on the CPU\): use 'chunked'"):
        TrainSpec(loss_impl=impl)


def test_a_head_the_kernels_cannot_take_is_refused_naming_chunked():
    check_head(torch.nn.Linear(HIDDEN, VOCAB, bias=False), "liger")  # a plain head passes
    with pytest.raises(ConfigError, match=r"^train.loss_impl=cce: the output head has a bias; use "
                                          r"train.loss_impl=chunked$"):
        check_head(torch.nn.Linear(HIDDEN, VOCAB), "cce")
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(HIDDEN, VOCAB, bias=False)),
                           LoraConfig(r=2, target_modules=["0"]))
    with pytest.raises(ConfigError, match=r"^train.loss_impl=liger takes the head's weight matrix and the head is a "
                                          r"Linear \(a LoRA-adapted"):
        check_head(model.base_model.model[0], "liger")


def test_a_missing_package_names_its_extra_and_an_old_liger_is_refused(monkeypatch):
    def version(name):
        if name == "liger-kernel":
            return "0.8.1"
        raise gpu_losses.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gpu_losses.metadata, "version", version)
    with pytest.raises(ConfigError, match=r"^train.loss_impl=cce needs cut-cross-entropy, an optional extra: "
                                          r"pip install -e '.\[cce\]'$"):
        gpu_losses._package("cce")
    with pytest.raises(ConfigError, match=r"^train.loss_impl=liger needs liger-kernel >= 0.8.2 .*found 0.8.1$"):
        gpu_losses._package("liger")


def torch_kernel(rows, weight, targets, softcap):
    """What both kernels compute, in torch: per-token cross-entropy of ``rows @ weight.T`` (fp32)."""
    logits = rows @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, reduction="none")


@pytest.mark.parametrize("reduction", ["token", "sample", "square"])
@pytest.mark.parametrize("span", [None, (3, 9)])
def test_the_glue_around_a_kernel_gives_the_chunked_loss(monkeypatch, reduction, span):
    monkeypatch.setattr(gpu_losses, "_package", lambda impl: torch_kernel)
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    width = WIDTH if span is None else span[1] - span[0]
    hidden = torch.randn(3, width, HIDDEN, requires_grad=True)
    results = []
    for fused in (False, True):
        if fused:
            rows, targets, _, flat = supervised_rows(hidden, LABELS, span)
            part = fused_token_loss("liger", rows, targets, flat, head, LABELS, SEG, reduction, span, 30.0)
        else:
            part = chunked_token_loss(hidden, head, LABELS, SEG, reduction, span, 4, 30.0)
        loss = part.weighted_sum / part.weight_total
        results.append((loss, torch.autograd.grad(loss, [hidden, head.weight])))
    (loss, grads), (fused_loss, fused_grads) = results
    assert abs(float(fused_loss - loss)) <= 1e-6 * abs(float(loss))
    for a, b in zip(grads, fused_grads):
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())
