"""Rows of the pairwise feature matrix, part 2 of 4 (``feature_matrix_rows.py`` says what each row checks)."""

from feature_matrix_rows import references, row_test  # noqa: F401 - references: the rows' module fixture

test_row_gives_megatrons_1f1b_losses = row_test(1)
