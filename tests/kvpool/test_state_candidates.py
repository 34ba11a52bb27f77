"""Where ``Client.plan`` looks for state objects (:func:`kvpool.client.handoff.state_candidates`): pure."""

from kvpool.client.handoff import state_candidates


def test_the_last_boundary_leaving_window_and_rollback_and_the_one_before() -> None:
    # 1000-token prompt, 8 blocks of 128 matched; window 128 + rollback 6 cap the attach at 866.
    assert state_candidates(1000, 8 * 128, 8, 128, 128, 6) == [768, 640]
    assert state_candidates(1000, 2 * 128, 8, 128, 128, 6) == [256, 128]
    assert state_candidates(1000, 1 * 128, 8, 128, 128, 6) == [128]  # no boundary before the first block


def test_no_window_no_match_or_too_few_keys_is_no_candidate() -> None:
    assert state_candidates(1000, 8 * 128, 8, 128, 0, 6) == []
    assert state_candidates(1000, 0, 8, 128, 128, 6) == []
    assert state_candidates(1000, 8 * 128, 5, 128, 128, 6) == [640]  # 768 needs a 6th key
