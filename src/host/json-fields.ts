// Fields of a JSON request message that its type does not have, by path
// ("holdr", "key.sesionId"), so that a typo is refused naming every one of
// them rather than ignored (connect-es ignores unknown JSON fields by
// default; protobuf-es, refusing them, names only the first).
//
// A key is known when it is a field's JSON name or its proto name, as
// protobuf-es reads it. Well-known types (google.protobuf.*) have JSON forms
// of their own (a Duration is "10s") and are not walked; protobuf-es judges
// them, and everything else about the message, when it parses it.

import { type DescMessage, fromJson } from "@bufbuild/protobuf";

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

// What a well-known type's JSON form looks like, for the message that names
// the field (protobuf-es names only the type: "cannot decode message
// google.protobuf.Duration from JSON: 30").
const wellKnownForms: Record<string, string> = {
  "google.protobuf.Duration": 'a duration string such as "30s" or "1.5s"',
  "google.protobuf.Timestamp": 'an RFC 3339 time such as "2026-01-02T15:04:05Z"',
};

/**
 * The first field of a JSON request whose value its well-known type
 * (a Duration, a Timestamp) does not take, as a message that starts with
 * the field's path: `ttl must be a duration string such as "30s" or "1.5s", got 30`.
 */
export function badWellKnownJson(desc: DescMessage, json: unknown): string | undefined {
  return check(desc, json, "");
}

function check(desc: DescMessage, value: unknown, prefix: string): string | undefined {
  if (!isObject(value) || desc.typeName.startsWith("google.protobuf.")) return undefined;
  for (const [key, inner] of Object.entries(value)) {
    const field = desc.fields.find((f) => f.jsonName === key || f.name === key);
    if (field === undefined || field.fieldKind !== "message" || inner === null) continue;
    const path = `${prefix}${field.name}`;
    const form = wellKnownForms[field.message.typeName];
    if (form === undefined) {
      const found = check(field.message, inner, `${path}.`);
      if (found !== undefined) return found;
      continue;
    }
    try {
      fromJson(field.message, inner as never);
    } catch {
      return `${path} must be ${form}, got ${JSON.stringify(inner)}`;
    }
  }
  return undefined;
}
