// Placeholder: replaced by the walkthrough program.
int main() { return 0; }
