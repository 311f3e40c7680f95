"""A test that needs ../shared skips visibly on a user's clone and fails under CI."""

import pytest

from shared_data import REQUIRE, shared_path


def test_missing_shared_data_skips_for_users_and_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("DYN_PLUGIN_SHARED", str(tmp_path))
    (tmp_path / "here.txt").write_text("x")
    assert shared_path("here.txt") == tmp_path / "here.txt"
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs .*missing"):
        shared_path("missing")
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match="turns this skip into a failure"):
        shared_path("missing")
