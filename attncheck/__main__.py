from attncheck.cli import main

main()
