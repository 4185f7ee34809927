/** Encrypts secrets at rest; the command layer seals tokens before they enter an event. */
export interface SecretBox {
  seal(plaintext: string, context: string): string;
  open(sealed: string, context: string): string;
}
