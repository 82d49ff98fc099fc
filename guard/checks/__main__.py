"""``python -m guard.checks --readme-table``: print the README's checks table from the registry."""
import sys

from . import readme_table

if __name__ == "__main__":
    if sys.argv[1:] != ["--readme-table"]:
        sys.stderr.write("usage: python -m guard.checks --readme-table\n")
        sys.exit(2)
    sys.stdout.write(readme_table())
