"""``kvlens report``: one self-contained HTML page from what the other commands wrote.

Public API: ``build_report(run_dir)`` (the page's content, missing parts named) and
``write_report(run_dir, output)``. ``kvlens.report.artifacts`` is the contract: which JSON file
each command writes beside its outputs. The report only reads those files and the figures they
name; it never re-runs anything.
"""
