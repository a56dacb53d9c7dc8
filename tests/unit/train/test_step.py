"""pipeline.train.step and the model's chunked loss: the loss over real tokens, summed exactly."""

from __future__ import annotations

import pytest
import torch

from pipeline.train.step import lm_loss


def test_loss_counts_real_tokens_only_and_sums_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[1, 3:] = -100
    loss, total, count = lm_loss(logits, labels)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    assert count == 8
    assert torch.allclose(loss, ref, rtol=1e-6)
    assert total.dtype == torch.float64 and abs(float(total) / count - float(ref)) < 1e-6


@pytest.mark.parametrize("chunk", [7, 48, None])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(chunk: int | None) -> None:
    from pipeline.model import build_model, resolve_shape
    from pipeline.train.step import reduce_token_losses

    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, 300))
    model.loss_chunk_tokens = chunk
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 33), generator=g)
    labels = torch.randint(0, 300, (3, 33), generator=g)
    labels[2, 20:] = -100

    plain, plain_total, n = lm_loss(model(input_ids=ids).logits, labels)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    chunked, chunked_total, m = reduce_token_losses(model(input_ids=ids, loss_labels=labels), labels)
    chunked.backward()
    assert n == m == 86
    assert torch.allclose(chunked, plain, rtol=1e-6, atol=0)
    assert abs(float(chunked_total) - float(plain_total)) <= 1e-6 * abs(float(plain_total))
    for p, ref in zip(model.parameters(), plain_grads, strict=True):
        assert torch.allclose(p.grad, ref, rtol=1e-5, atol=1e-7)


def test_documents_packed_in_one_sample_do_not_see_each_other() -> None:
    """Samples of whole documents (pipeline shard --whole-documents): with the loader's positions, each
    document's token losses in the packed sample are those of the document alone, and its gradients too; without
    them (plain causal attention) they are not, so the mask is what makes the difference."""
    from pipeline.data.loader import document_positions
    from pipeline.model import build_model, resolve_shape

    eos = 2
    torch.manual_seed(0)
    model = build_model(resolve_shape("tiny", {}, 300)).eval()
    g = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(4, 300, (n - 1,), generator=g), torch.tensor([eos])]) for n in (9, 14, 6)]
    packed = torch.cat(docs)[None]
    labels = torch.cat([packed[:, 1:], torch.tensor([[-100]])], 1)
    labels[packed == eos] = -100
    positions = document_positions(packed, eos)
    assert positions[0].tolist() == list(range(9)) + list(range(14)) + list(range(6))
    together = model(input_ids=packed, loss_labels=labels, position_ids=positions).reshape(-1)
    crossing = model(input_ids=packed, loss_labels=labels).reshape(-1)
    at = 0
    for doc in docs:
        alone = model(input_ids=doc[None], loss_labels=torch.cat([doc[1:], torch.tensor([-100])])[None]).reshape(-1)
        assert torch.allclose(together[at : at + len(doc) - 1], alone[:-1], rtol=1e-5, atol=1e-6)
        at += len(doc)
    assert not torch.allclose(together, crossing, rtol=1e-3), "without positions the documents would mix"
