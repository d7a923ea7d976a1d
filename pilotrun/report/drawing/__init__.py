"""Drawing the evidence: the PNG plots and the self-contained report.html."""
