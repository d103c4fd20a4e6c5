from actmem.cli.main import main

main()
