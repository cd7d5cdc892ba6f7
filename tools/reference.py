"""An independent, literal implementation of the seed's loops, for comparison.

concat_matrix and batch_matrix are the seed's code. The objectives are written
in a different form from app/core/objectives.py on purpose.
"""
import torch


def concat_matrix(vectors_):
    vectors = vectors_.clone()
    seq_len, dim_vec = vectors.shape
    project_x = vectors.repeat((1, 1, seq_len)).reshape(seq_len, seq_len, dim_vec)
    project_y = project_x.permute(1, 0, 2)
    matrix = torch.cat((project_x, project_y), dim=-1)
    matrix_ = matrix.clone()
    return matrix_


def batch_matrix(vector_pairs, factor=2):
    baselen = len(vector_pairs[0]) // factor
    split_batch = []
    for j in range(factor):
        for i in range(factor):
            start_j = j * baselen
            end_j = (j + 1) * baselen if j != factor - 1 else None
            start_i = i * baselen
            end_i = (i + 1) * baselen if i != factor - 1 else None
            mini_pairs = vector_pairs[start_j:end_j, start_i:end_i, :]
            split_batch.append(mini_pairs)
    return split_batch


REFERENCE_OBJECTIVES = {
    "sum": lambda b, offset: torch.sum(b + offset),
    "mean": lambda b, offset: b.sum() / b.numel(),
    "sum_of_squares": lambda b, offset: (b ** 2).sum(),
    "l2_norm": lambda b, offset: torch.sqrt((b * b).sum()),
    "logsumexp": lambda b, offset: torch.log(torch.exp(b).sum()),
}


def shifted_logsumexp(b, offset):
    """log(sum(exp(B))) with the block's max m taken out: m + log(sum(exp(B - m))).

    The same value as the literal one, which overflows (exp(100) in float32) and then
    gives a gradient of 0 where the true one is tiny but not zero.
    """
    m = b.detach().max()
    return m + torch.log(torch.exp(b - m).sum())


# The literal objectives, except logsumexp written max-shifted: an oracle that stays right
# where the literal form overflows.
SHIFTED_OBJECTIVES = {**REFERENCE_OBJECTIVES, "logsumexp": shifted_logsumexp}


def reference_accumulated(vectors, factor, objective, offset=5.0, objectives=REFERENCE_OBJECTIVES):
    """Shared graph, backward(retain_graph=True) once per block: sums onto V."""
    leaf = vectors.clone().requires_grad_(True)
    loss_fn = objectives[objective]
    for block in batch_matrix(concat_matrix(leaf), factor=factor):
        loss_fn(block, offset).backward(retain_graph=True)
    return leaf.grad


def reference_blocks(vectors, factor, objective, offset=5.0, objectives=REFERENCE_OBJECTIVES):
    """Detach each block as its own leaf: independent (loss, gradient) pairs."""
    loss_fn = objectives[objective]
    out = []
    for i in batch_matrix(concat_matrix(vectors), factor=factor):
        i = i.detach()
        i.requires_grad = True
        summed = loss_fn(i, offset)
        summed.backward()
        out.append((summed.detach(), i.grad))
    return out


def model_block_loss(score, block):
    """A model objective written out: the scores of the block's h x w pairs, summed."""
    rows, cols, width = block.shape
    return score(block.reshape(rows * cols, width)).sum()


def reference_model_blocks(vectors, factor, score):
    """Each block detached as its own leaf, the model applied to it, autograd.grad: (loss, gradient)."""
    out = []
    for block in batch_matrix(concat_matrix(vectors), factor=factor):
        leaf = block.detach().requires_grad_(True)
        loss = model_block_loss(score, leaf)
        (grad,) = torch.autograd.grad(loss, leaf)
        out.append((loss.detach(), grad))
    return out


def reference_model_accumulated(vectors, factor, score):
    """One shared graph, backward(retain_graph=True) once per block: sums onto V."""
    leaf = vectors.clone().requires_grad_(True)
    for block in batch_matrix(concat_matrix(leaf), factor=factor):
        model_block_loss(score, block).backward(retain_graph=True)
    return leaf.grad
