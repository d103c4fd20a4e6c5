"""The README's example first: `actmem estimate --model 530b`.

Hand derivation for MT-NLG 530B as Table 3 trains it (a=128, h=20480, L=105, v=51200,
s=2048; t=8, p=35, m=3, b=1, 280 GPUs, global batch 280; SP + selective recompute):

  sbh                      = 2048·20480                      = 41,943,040
  per layer (Eq 6 row)     = 34·sbh/t                        = 178,257,920
  layers held (sec 4.4)    = L·(1 + (p-1)/(pm)) = 105 + 34   = 139
  embedding masks (4.5)    = sbh·2p/t                        = 367,001,600
      (section 4.5 counts p microbatches; at the peak of the interleaved schedule the
      first stage holds 2p: see actmem/memory/pipeline.py, measured by the harness)
  parameters, first stage  = 3 layers·((12h²+7h)/t + 6h) + v·h/t + s·h
                           = 3·629,286,400 + 131,072,000 + 41,943,040 = 2,060,874,240
  optimizer etc.           = 18 B a parameter
  dummy weight gradients   = TE's cached 16-bit tensor for each linear weight shape: QKV
                             [3h/t, h], projection [h, h/t], fc1 [4h/t, h], fc2 [h, 4h/t]
                           = 12h²/t elements x 2 B = 629,145,600 x 2 = 1,258,291,200
                             (no output layer on the first of 35 stages)
"""

from tests.conftest import Cli

S, H, A, L, V = 2048, 20480, 128, 105, 51200
T, P, M = 8, 35, 3
SBH = S * H  # b = 1


def test_readme_example_renders_and_fits():
    result = Cli()("estimate", "--model", "530b")
    assert result.exit_code == 0, result.output
    # the verdict is the peak floor: 57.97 GiB of terms and parameters, + the dummy weight
    # gradients (1.1719 GiB), + the selective rerun (0.3125 GiB) - the last layer's rows freed
    # before it (0.1172 GiB) + the core's backward beyond the rerun (0.1543 GiB): 59.50 GiB
    # (tests/test_peak.py)
    # of an A100 80GB at what its allocator reaches, 85,056,798,720 B = 79.22 GiB; less the
    # peak floor (63,884,755,968 B, tests/test_stages.py) and the 8 GiB reserve:
    # 12,582,108,160 B = 11.72 GiB
    for text in ("tp-sp-sel", "fits", "23.42 GiB", "59.50 of 79.22 GiB",
                 "11.72 GiB to spare beyond the reserve of 8.00 GiB (A100 80GB)"):
        assert text in result.stdout


def test_readme_example_numbers():
    out = Cli().json("estimate", "--model", "530b")
    per_layer = 34 * SBH // T
    layers_held = L + (P - 1) * L // (P * M)
    assert layers_held == 139
    embedding = SBH * 2 * P // T
    assert out["stage"]["layer_activations"] == 139
    run = {row["technique"]: row for row in out["techniques"]}["tp-sp-sel"]
    assert run["per_layer_bytes"] == per_layer == 178_257_920
    assert run["layers_bytes"] == per_layer * 139
    assert run["extra_bytes"] == embedding == 367_001_600
    assert out["activations_bytes"] == per_layer * 139 + embedding == 25_144_852_480

    layer_params = (12 * H * H + 7 * H) // T + 6 * H
    count = L // P * layer_params + V * H // T + S * H
    assert count == 2_060_874_240
    assert out["parameters"]["count"] == count
    dummies = 2 * 12 * H * H // T
    assert out["parameters"]["dummy_wgrads_bytes"] == dummies == 1_258_291_200
    assert out["parameters"]["total_bytes"] == 18 * count + dummies
    assert out["total_bytes"] == 25_144_852_480 + 18 * count + dummies
    assert out["gpu_memory_bytes"] == 85_056_798_720          # an A100-SXM4-80GB's total_memory
    assert out["fits"] is True and out["verdict"] == "fits"
    assert out["spare_bytes"] == 85_056_798_720 - 8 * 2**30 - 63_884_755_968 == 12_582_108_160
