from actmem.cli import main

main()
