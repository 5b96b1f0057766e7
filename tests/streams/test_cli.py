from __future__ import annotations

import pytest

from xidstream.cli import main


@pytest.mark.slow
def test_process_reports_missing_topics_clearly(kafka_bootstrap, capsys):
    assert main(["process", "--bootstrap", kafka_bootstrap, "--topic-prefix", "never-created."]) == 2
    err = capsys.readouterr().err
    assert "topics missing" in err and "never-created.gpu.samples" in err and "xidstream topics create" in err


def test_process_config_file_and_policy_errors(tmp_path, capsys):
    conf = tmp_path / "c.yaml"
    conf.write_text("bootstrap: 127.0.0.1:1\ncolour: red\n")
    assert main(["process", "--config", str(conf)]) == 2
    assert "unknown setting(s) colour" in capsys.readouterr().err
    pol = tmp_path / "p.yaml"
    pol.write_text("pinned_seconds: soon\n")
    conf.write_text(f"policy: {pol}\n")
    assert main(["process", "--config", str(conf)]) == 2
    assert "pinned_seconds must be a number, got 'soon'" in capsys.readouterr().err


def test_breaker_reset_needs_a_processor_that_ran(kafka_bootstrap, capsys):
    assert main(["breaker", "reset", "--bootstrap", kafka_bootstrap, "--topic-prefix", "no-such-run."]) == 2
    assert "no processor has run with topic prefix 'no-such-run.'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["process", "--help"], ["breaker", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
