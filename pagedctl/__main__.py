from pagedctl.cli import main

main()
