"""What the user chose: sidebar inputs, picks, the address bar."""
