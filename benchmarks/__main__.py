from .run_all import main

main()
