"""The in-process token bucket: exact debt arithmetic with an injected clock."""

from hetps.transport.shaper import TokenBucket


def test_token_bucket_delays_exactly():
    tb = TokenBucket(1000.0, burst_bytes=500)
    tb.stamp = 0.0
    assert tb.delay_for(500, 0.0) == 0.0  # the burst goes at once
    assert tb.delay_for(1000, 0.0) == 1.0  # then 1000 bytes at 1000 B/s
    assert tb.delay_for(0, 1.0) == 0.0  # debt paid after 1 s
    assert tb.delay_for(250, 1.25) == 0.0  # 250 tokens refilled
    assert tb.delay_for(100, 1.25) == 0.1
