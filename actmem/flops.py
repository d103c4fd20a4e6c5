"""FLOPs per iteration (the paper's appendix) and the utilisations they give.

Arithmetic only, so it runs on ints, floats and numpy arrays alike.
"""

from actmem.terms import Recompute


def model_flops(B, s, L, h, v):
    """72·B·s·L·h²·(1 + s/(6h) + v/(12hL)): forward and backward (3x the forward) of the
    layers' matmuls (24Bsh² a layer), the attention scores (4Bs²h) and the logits (2Bshv)."""
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + v / (12 * h * L))


def hardware_flops(B, s, L, h, v, recompute: Recompute):
    """What the GPUs really compute, recomputation included (the paper's appendix).

    selective: the paper counts the attention-score part again, 72BsLh²·s/(6h), which is
    how it gets its 2.7% (GPT-3) and 1.6% (530B) overheads and the HFU column of Table 5.
    full: one more forward of every layer (24BsLh²·(1 + s/(6h))), not of the logits:
    96BsLh²·(1 + s/(6h) + v/(16hL)).
    """
    if recompute is Recompute.NONE:
        return model_flops(B, s, L, h, v)
    if recompute is Recompute.SELECTIVE:
        return 72 * B * s * L * h * h * (1 + s / (3 * h) + v / (12 * h * L))
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + v / (16 * h * L))


def utilization(flops, seconds, gpus, peak_flops):
    """Share of the GPUs' peak: MFU with model FLOPs, HFU with hardware FLOPs."""
    return flops / (seconds * gpus * peak_flops)


def flops_report(model, global_batch: int, gpus: int | None, peak_flops: float,
                 seconds: float | None) -> dict:
    """Model and hardware FLOPs per iteration for each recompute mode; MFU and HFU when an
    iteration time is given."""
    dims = dict(B=global_batch, s=model.seq_len, L=model.layers, h=model.hidden, v=model.vocab)
    flops = model_flops(**dims)
    report = {"global_batch": global_batch, "gpus": gpus, "peak_flops": peak_flops,
              "iteration_s": seconds, "model_flops": flops, "hardware": []}
    if seconds is not None:
        report["mfu"] = utilization(flops, seconds, gpus, peak_flops)
    for mode in Recompute:
        hardware = hardware_flops(**dims, recompute=mode)
        row = {"recompute": mode.value, "hardware_flops": hardware, "overhead": hardware / flops - 1}
        if seconds is not None:
            row["hfu"] = utilization(hardware, seconds, gpus, peak_flops)
        report["hardware"].append(row)
    return report
