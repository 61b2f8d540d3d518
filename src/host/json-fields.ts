// Fields of a JSON request message that its type does not have, by path
// ("holdr", "key.sesionId"), so that a typo is refused naming every one of
// them rather than ignored (connect-es ignores unknown JSON fields by
// default; protobuf-es, refusing them, names only the first).
//
// A key is known when it is a field's JSON name or its proto name, as
// protobuf-es reads it. Well-known types (google.protobuf.*) have JSON forms
// of their own (a Duration is "10s") and are not walked; protobuf-es judges
// them, and everything else about the message, when it parses it.

import type { DescMessage } from "@bufbuild/protobuf";

export function unknownJsonFields(desc: DescMessage, json: unknown): string[] {
  const found: string[] = [];
  walk(desc, json, "", found);
  return found;
}

function walk(desc: DescMessage, value: unknown, prefix: string, found: string[]): void {
  if (value === null || typeof value !== "object" || Array.isArray(value)) return;
  if (desc.typeName.startsWith("google.protobuf.")) return;
  for (const [key, inner] of Object.entries(value)) {
    const field = desc.fields.find((f) => f.jsonName === key || f.name === key);
    if (field === undefined) {
      found.push(prefix + key);
      continue;
    }
    const path = `${prefix}${field.name}`;
    if (field.fieldKind === "message") {
      walk(field.message, inner, `${path}.`, found);
    } else if (field.fieldKind === "list" && field.listKind === "message" && Array.isArray(inner)) {
      for (const [i, item] of inner.entries()) walk(field.message, item, `${path}[${i}].`, found);
    } else if (field.fieldKind === "map" && field.mapKind === "message" && isObject(inner)) {
      for (const [k, item] of Object.entries(inner)) {
        walk(field.message, item, `${path}[${JSON.stringify(k)}].`, found);
      }
    }
  }
}

function isObject(value: unknown): value is Record<string, unknown> {
  return value !== null && typeof value === "object" && !Array.isArray(value);
}
