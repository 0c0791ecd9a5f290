"""`python -m orthosphere ...` runs the command line, as `orthosphere ...` does."""
from orthosphere.workflows.cli import main

if __name__ == "__main__":
    main(prog_name="orthosphere")
