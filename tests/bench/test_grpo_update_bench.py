"""`python -m muajax.bench grpo_update`: packed GRPO rows compute close to the real tokens
of the τ2 retail profile's lengths, padded ones about twice them."""
import json
import subprocess
import sys

from muajax.bench.grpo_update import run
from muajax.runtime.grpo_packing import computed_positions, row_buckets


def test_packed_rows_hold_the_retail_profile_within_1_3_of_its_real_tokens():
    out = run(["--samples", "4"])
    assert out["profile"] == "tau2-retail" and out["rollouts"] == 256
    assert out["packed_computed_over_real"] <= 1.3 < 1.8 <= out["padded_computed_over_real"]
    assert out["packed_over_padded"] < 0.7


def test_the_counts_are_the_rows_as_packed():
    # 4 trajectories of 300 tokens at bucket 512: two rows can hold none together -> 4 rows;
    # of 200 tokens: two per row -> 2 rows (row buckets of 4 rows in steps of 1)
    assert computed_positions([300] * 4, 512, shared_prefix=0, row_buckets_=row_buckets(4, 1))["packed"] == 4 * 512
    counts = computed_positions([200] * 4, 512, shared_prefix=0, row_buckets_=row_buckets(4, 1))
    assert counts == {"real": 800, "packed": 2 * 512, "padded": 4 * 512, "rows": 2, "padded_rows": 4}
    # a 100-token shared prefix: once per microbatch, and the rows hold the rest
    counts = computed_positions([300] * 4, 512, shared_prefix=100, row_buckets_=row_buckets(4, 2), microbatches=2)
    assert counts["real"] == 4 * 200 + 200 and counts["packed"] == 2 * 412 + 200


def test_the_command_ends_with_one_json_line():
    done = subprocess.run([sys.executable, "-m", "muajax.bench", "grpo_update", "--samples", "2"],
                          capture_output=True, text=True, timeout=120, check=True)
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["benchmark"] == "grpo_update" and "packed_computed_over_real" in last
