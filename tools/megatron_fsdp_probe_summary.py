"""Per-rank table from tools/megatron_fsdp_probe.py --json output, each number checked against the closed-form
formula (a session's prototype for issue 30: Megatron-FSDP's model state, measured; not yet the harness's).

    python tools/megatron_fsdp_probe_summary.py w2_bf16.json [...]
"""
import json
import math
import sys

SZ = {"bfloat16": 2, "float16": 2, "float32": 4}


def pad(x, d):
    return -(-x // d) * d


def layout_size(shapes, f):
    """build_data_parallel_buffer_index's unpadded data_index for items whose numel is a multiple of f or < f
    (fragments packed at the end) - the only case in this model; the probe replays the real function too."""
    regular = [math.prod(s) for s in shapes if math.prod(s) >= f]
    frags = [math.prod(s) for s in shapes if math.prod(s) < f]
    assert all(n % f == 0 for n in regular), "gap-filling case: use the replay in mfsdp_probe.padded_size"
    return sum(regular) + sum(frags)


def chunk_factor(shapes):
    f = 1
    for s in sorted(shapes, key=lambda s: -math.prod(s[1:])):
        r = math.prod(s[1:])
        if not (r == f or (f % r == 0 and math.prod(s) % f == 0) or math.prod(s) < f):
            f = math.lcm(f, r)
    return f


def local_unpadded(layout, shard_start, shard_size):
    """Elements of real parameters inside this rank's shard [start, start+size) of the padded bucket."""
    return sum(max(0, min(o + n, shard_start + shard_size) - max(o, shard_start)) for o, n in layout)


def expected(o, W, rank):
    strat, pdt = o["strategy"], o["dtype"]
    p = SZ[pdt]
    g = 4 if o["grad_reduce_in_fp32"] else p
    N = o["N"]
    P = S = nloc = 0
    for b in o["buckets"]:
        f = chunk_factor([tuple(s) for s in b["shapes"]])
        assert f == b["chunk_size_factor"]
        L = layout_size([tuple(s) for s in b["shapes"]], f)
        Pb = L if strat == "no_shard" else pad(L, W * f)
        buf = b["mbuf"] or b["gbuf"]
        assert Pb == buf["padded_bucket"], (Pb, buf["padded_bucket"])
        Sb = Pb // W
        P += Pb
        S += Sb
        nloc += local_unpadded(buf["layout"], rank * Sb, Sb)
    if strat == "no_shard":
        nloc = N
    w = dict(no_shard=p * N, optim=p * P, optim_grads=p * P, optim_grads_params=p * S)[strat]
    m = 4 * (N if strat == "no_shard" else S)
    gr = g * dict(no_shard=N, optim=P, optim_grads=S, optim_grads_params=S)[strat]
    dmg = 0 if g == 4 else 4 * nloc          # update_main_grads' .to(fp32) copy, kept in dist_main_grad
    adam = 8 * nloc
    return dict(weights=w, main_weights=m, grads=gr, dist_main_grad=dmg, adam=adam, P=P, S=S, nloc=nloc)


def measured(o):
    st = o.get("after_step") or o["built"]
    adam = sum(n * SZ[dt] for k, _, n, dt in o.get("adam", []) if k in ("exp_avg", "exp_avg_sq"))
    return dict(weights=st.get("weights", 0), main_weights=st.get("main_weights", 0), grads=st.get("grads", 0),
                dist_main_grad=st.get("dist_main_grad", 0), adam=adam, temp=st.get("temp_buckets", 0))


def main():
    for path in sys.argv[1:]:
        d = json.load(open(path))
        W = len(d)
        print(f"\n## {path}: dp={W}")
        print("| strategy | grad fp32 | rank | weights | main wts | grads | dist_main_grad | Adam m+v | temp buckets "
              "| sum | formula ok | loss2 - ref | grad norm^2 / ref |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        ref = d["0"][0].get("reference")
        for i in range(len(d["0"])):
            for r in sorted(d, key=int):
                o = d[r][i]
                if "reference" in o:
                    continue
                if "error" in o:
                    print(f"| {o['strategy']} | {o['grad_reduce_in_fp32']} | {r} | ERROR {o['error']} |")
                    continue
                me, ex = measured(o), expected(o, W, int(r))
                ok = all(me[k] == ex[k] for k in ("weights", "main_weights", "grads", "dist_main_grad", "adam")) \
                    if "adam" in o else all(me[k] == ex[k] for k in ("weights", "main_weights", "grads"))
                total = sum(me[k] for k in ("weights", "main_weights", "grads", "dist_main_grad", "adam"))
                lossok = ""
                if ref and "step" in o:
                    dl = o["step"]["loss2"] - ref[1][int(r)]
                    lossok = f"{dl:+.1e}" + ("" if abs(dl) < 1e-3 else " WRONG")
                    gr = o["grad_sq"] / ref[2]
                    lossok += f" | {gr:.3f}" + ("" if abs(gr - 1) < 1e-2 else " WRONG")
                print(f"| {o['strategy']} | {o['grad_reduce_in_fp32']} | {r} | {me['weights']} | {me['main_weights']} | "
                      f"{me['grads']} | {me['dist_main_grad']} | {me['adam']} | {me['temp']} | {total} | "
                      f"{'yes' if ok else 'NO ' + str(ex)} | {lossok} |")
            if "N" in d["0"][i] and d["0"][i]["strategy"] != "no_shard":
                ex = expected(d["0"][i], W, 0)
        o = next(x for x in d["0"] if "N" in x and x["strategy"] == "optim_grads_params")
        print(f"N={o['N']}; per bucket (optim_grads_params): " + "; ".join(
            f"n={b['unpadded']} f={b['chunk_size_factor']} padded={b['mbuf']['padded_bucket']}" for b in o["buckets"]))
        o = next(x for x in d["0"] if "N" in x and x["strategy"] == "optim")
        print("optim/optim_grads: " + "; ".join(
            f"n={b['unpadded']} f={b['chunk_size_factor']} padded={b['mbuf']['padded_bucket']}" for b in o["buckets"]))


if __name__ == "__main__":
    main()
