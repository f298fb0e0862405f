"""Request validation without a server: values JSON cannot carry (NaN, inf) are refused
too, when a caller hands `parse_request` Python values directly."""
import math

import pytest

from muajax.serving.protocol import ApiError, Limits, parse_request
from tests.serving.test_serve import MODEL, USER

LIMITS = Limits(context=1024, vocab_size=151936)
GOOD = {"model": MODEL, "messages": USER}


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_are_refused(field, value):
    with pytest.raises(ApiError) as e:
        parse_request({**GOOD, field: value}, MODEL, LIMITS)
    assert e.value.status == 400 and e.value.param == field


def test_limits_bound_top_k_and_max_tokens_inclusively():
    req = parse_request({**GOOD, "top_k": LIMITS.vocab_size, "max_tokens": LIMITS.context, "seed": 2**63 - 1},
                        MODEL, LIMITS)
    assert (req.top_k, req.max_tokens, req.seed) == (LIMITS.vocab_size, LIMITS.context, 2**32 - 1)
    assert parse_request({**GOOD, "top_k": -1}, MODEL, LIMITS).top_k == 0  # vLLM's "off"
    for field, value in (("top_k", LIMITS.vocab_size + 1), ("max_tokens", LIMITS.context + 1)):
        with pytest.raises(ApiError, match=f"'{field}' must be in"):
            parse_request({**GOOD, field: value}, MODEL, LIMITS)
