"""The `loka report` page: one self-contained HTML file with the plan and its plots."""

from loka.dispatch.report.html import FIGURES, render_report, write_report

__all__ = ["FIGURES", "render_report", "write_report"]
