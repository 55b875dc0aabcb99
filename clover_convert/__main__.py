from .cli import main

main(prog_name="python -m clover_convert")
