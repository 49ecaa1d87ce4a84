// Command relay will run the outbox relay loop (the binary in every relay pod).
package main

func main() {}
