from kvlens.cli import main

main()
